"""Config of the DPO pipeline: the policy and its frozen reference, preference pairs, the loss, schedule and export."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.algorithms.preference_losses import PreferenceLossType
from roll.configs.schema import ConfigError, check
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.pipeline_config import EXP_NAME
from roll.pipeline.base.preference_config import PreferenceRunConfig


@dataclass
class PreferenceLossArguments:
    """The preference loss: DPO's `sigmoid` (with cDPO's `label_smoothing`), `ipo`, or `kto` on labelled
    completions (`data.format=unpaired`) or on pairs read unpaired (chosen desirable, rejected undesirable);
    `beta` scales the implicit reward."""

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
        """One DPO step's arithmetic: examples -> rows -> ranks -> micro-batches, and the reference's passes."""
        rows, train, reference = self.rows_per_example() * self.batch_size, self.actor_train, self.reference
        args = train.training_args
        # KTO also scores each row's prompt with another row's completion (its reference point) on both models.
        scored = 2 * rows if self.loss.loss_type == "kto" else rows
        shard = scored // reference.dp_size
        if self.data.format == "pairs":
            examples = f"pairs: {self.batch_size} per optimizer step = {rows} rows (chosen and rejected side by side)"
            pairs = args.per_device_train_batch_size // 2
            micro = f"{args.per_device_train_batch_size} rows ({pairs} pairs, one forward pass)"
        else:
            examples = f"labelled completions: {self.batch_size} per optimizer step = {rows} rows"
            micro = f"{args.per_device_train_batch_size} rows"
        plan = [
            examples,
            f"actor_train: {rows // train.dp_size} rows per rank on {train.dp_size} rank(s) -> micro-batches of "
            f"{micro} x {args.gradient_accumulation_steps} accumulation; {self.max_steps} steps",
            f"reference: {shard} rows per rank on {reference.dp_size} rank(s) in forward passes of "
            f"{reference.infer_batch_size} ({-(-shard // reference.infer_batch_size)} per rank), once per batch",
        ]
        if self.loss.loss_type == "kto":
            plan.append(
                f"kto reference point: {rows} mismatched rows (a prompt with another row's completion) scored by "
                "the policy (no gradient) and the reference each step"
            )
        return plan

    def validate(self) -> None:
        """Roles, that a step is whole examples in every micro-batch, the data format and loss options, then
        models, data, resume."""
        self.check_pretrain_written("DPO starts from a fine-tuned model; write the SFT export first", "roll-sft", "sft")
        super().validate()
        self.check_format_fields()
        train, loss, data_format = self.actor_train, self.loss, self.data.format
        if data_format == "steps":
            raise ConfigError(
                "data.format=steps trains a process reward model (roll-rm); DPO takes data.format=pairs or unpaired"
            )
        if data_format == "unpaired" and loss.loss_type != "kto":
            raise ConfigError(
                f"data.format=unpaired has no pairs for loss.loss_type={loss.loss_type}; set loss.loss_type=kto "
                "(or give pairs with data.format=pairs)"
            )
        if loss.loss_type == "kto" and self.batch_size < 2:
            raise ConfigError(
                f"batch_size={self.batch_size} with loss.loss_type=kto: KTO's reference point scores the prompts of "
                "a step with completions of other prompts, and a step of one "
                f"{'pair' if data_format == 'pairs' else 'labelled completion'} has a single prompt; set batch_size "
                "to 2 or more"
            )
        self.check_example_training("actor_train", train)
        rows = self.rows_per_example() * self.batch_size
        self.check_divisible(f"batch_size x {self.rows_per_example()} (rows)", rows, self.reference)
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
