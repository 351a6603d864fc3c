"""Config of the DPO pipeline: the policy and its frozen reference, preference pairs, the loss, schedule and export."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from roll.configs.schema import ConfigError, check
from roll.configs.worker_config import WorkerConfig
from roll.models.tiny import TINY_SCHEME
from roll.pipeline.base_config import EXP_NAME
from roll.pipeline.preference_config import PreferenceRunConfig
from roll.utils.dpo_losses import PreferenceLossType


@dataclass
class PreferenceLossArguments:
    """The preference loss: DPO's `sigmoid` (with cDPO's `label_smoothing`), `ipo`, or `kto` on the pairs' rows
    taken unpaired (chosen rows desirable, rejected rows undesirable); `beta` scales the implicit reward."""

    loss_type: PreferenceLossType = "sigmoid"
    beta: float = field(default=0.1, metadata=check(gt=0))
    # The probability that a pair's preference label is flipped (conservative DPO); sigmoid only.
    label_smoothing: float = field(default=0.0, metadata=check(ge=0, lt=0.5))
    kto_desirable_weight: float = field(default=1.0, metadata=check(gt=0))
    kto_undesirable_weight: float = field(default=1.0, metadata=check(gt=0))


@dataclass
class DPOConfig(PreferenceRunConfig):
    """Direct preference optimisation of `actor_train` against a frozen `reference`; the result is a HF export."""

    exp_name: str = field(default="dpo", metadata=check(EXP_NAME))
    loss: PreferenceLossArguments = field(default_factory=PreferenceLossArguments)
    actor_train: WorkerConfig = field(default_factory=WorkerConfig)
    reference: WorkerConfig = field(default_factory=WorkerConfig)

    def batch_plan(self) -> list[str]:
        """One DPO step's arithmetic: pairs -> rows -> ranks -> micro-batches, and the reference's passes."""
        rows, train, reference = 2 * self.batch_size, self.actor_train, self.reference
        args = train.training_args
        shard = rows // reference.dp_size
        return [
            f"pairs: {self.batch_size} per optimizer step = {rows} rows (chosen and rejected side by side)",
            f"actor_train: {rows // train.dp_size} rows per rank on {train.dp_size} rank(s) -> micro-batches of "
            f"{args.per_device_train_batch_size} rows ({args.per_device_train_batch_size // 2} pairs, one forward "
            f"pass) x {args.gradient_accumulation_steps} accumulation; {self.max_steps} steps",
            f"reference: {shard} rows per rank on {reference.dp_size} rank(s) in forward passes of "
            f"{reference.infer_batch_size} ({-(-shard // reference.infer_batch_size)} per rank), once per batch",
        ]

    def validate(self) -> None:
        """Roles, that a step is whole pairs in every micro-batch, the loss options, then models, data, resume."""
        self._check_pretrain()
        super().validate()
        train = self.actor_train
        self.check_pair_training("actor_train", train)
        self.check_divisible("batch_size x 2 (rows)", 2 * self.batch_size, self.reference)
        loss = self.loss
        if loss.label_smoothing and loss.loss_type != "sigmoid":
            raise ConfigError(
                f"loss.label_smoothing={loss.label_smoothing} applies to loss.loss_type=sigmoid only, not "
                f"{loss.loss_type}; set it to 0"
            )
        for name in ("kto_desirable_weight", "kto_undesirable_weight"):
            weight = getattr(loss, name)
            if weight != 1.0 and loss.loss_type != "kto":
                raise ConfigError(
                    f"loss.{name}={weight} applies to loss.loss_type=kto only, not {loss.loss_type}; leave it at 1"
                )
        self.check_inputs([train, self.reference])

    def _check_pretrain(self) -> None:
        """A missing `pretrain` directory is most often the SFT export not written yet: say how to write it."""
        path = self.pretrain
        if path and not path.startswith(TINY_SCHEME) and not Path(path).is_dir():
            raise ConfigError(
                f"pretrain={path!r} does not exist: DPO starts from a fine-tuned model; write the SFT export first "
                "(`roll-sft` writes <output_dir>/sft/model) or set pretrain to a model directory"
            )
