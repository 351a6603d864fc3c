"""Config of the DPO pipeline: the policy and its frozen reference, preference pairs, the loss, schedule and export."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from roll.configs.data_config import PreferenceDataArguments
from roll.configs.schema import ConfigError, any_value, check, checked_in_validate
from roll.configs.worker_config import WorkerConfig
from roll.datasets.arithmetic import arithmetic_problems
from roll.distributed.strategy.registry import strategy_class
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import TINY_SCHEME
from roll.pipeline.base_config import EXP_NAME, PipelineConfig
from roll.pipeline.checkpoint_state import load_driver_state
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
class DPOConfig(PipelineConfig):
    """Direct preference optimisation of `actor_train` against a frozen `reference`; the result is a HF export."""

    exp_name: str = field(default="dpo", metadata=check(EXP_NAME))
    pretrain: str = field(
        default="", metadata=any_value("only interpolated (${pretrain}) into model paths, which validate() checks")
    )
    max_steps: int = field(default=100, metadata=check(ge=1))
    # Preference pairs per optimizer step over all ranks (each pair is two rows: chosen and rejected).
    batch_size: int = field(default=32, metadata=check(ge=1))
    # Held-out preference accuracy every N steps (and before the first and after the last).
    eval_steps: int = field(default=25, metadata=check(ge=1))
    eval_batch_size: int = field(default=0, metadata=check(ge=0, hint="0 evaluates every held-out pair"))
    save_steps: int = field(default=0, metadata=check(ge=0, hint="0 saves only at the end"))
    # A checkpoint directory, or "latest" under run_dir/checkpoints.
    resume_from_checkpoint: str = field(
        default="", metadata=checked_in_validate("whether the checkpoint exists is the filesystem's", "step_999999")
    )
    max_response_length: int = field(default=8, metadata=check(ge=1))
    export_dir: str = field(
        default="", metadata=any_value("any directory to write the model to; empty = <run_dir>/model")
    )
    loss: PreferenceLossArguments = field(default_factory=PreferenceLossArguments)
    data: PreferenceDataArguments = field(default_factory=PreferenceDataArguments)
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

    def sequence_lengths(self) -> tuple[int, int, int | None]:
        """The longest prompt and the longest response."""
        return self.data.max_prompt_length, self.max_response_length, None

    def validate(self) -> None:
        """Roles, that a step is whole pairs in every micro-batch, the loss options, then models, data, resume."""
        self._check_pretrain()
        super().validate()
        train = self.actor_train
        strategy = train.strategy_args.strategy_name if train.strategy_args else None
        if strategy is None or not strategy_class(strategy).trains():
            raise ConfigError(f"actor_train.strategy_args.strategy_name={strategy} does not train; use deepspeed_train")
        args = train.training_args
        if args.per_device_train_batch_size % 2:
            raise ConfigError(
                f"actor_train.training_args.per_device_train_batch_size={args.per_device_train_batch_size} must be "
                "even: a micro-batch holds whole pairs (a chosen and a rejected row each)"
            )
        if train.max_tokens_per_microbatch is not None:
            raise ConfigError(
                "actor_train.max_tokens_per_microbatch must be null for DPO: a token budget regroups rows and "
                "would split a pair's chosen and rejected rows over micro-batches"
            )
        step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * train.dp_size
        if 2 * self.batch_size != step_rows:
            raise ConfigError(
                f"batch_size={self.batch_size} pairs are {2 * self.batch_size} rows, which must equal actor_train "
                f"per_device_train_batch_size x gradient_accumulation_steps x dp size = {step_rows}"
            )
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
        facts = self.check_models([train, self.reference])
        tokens = self.data.max_prompt_length + self.max_response_length
        self.check_lengths(
            facts,
            tokens,
            f"data.max_prompt_length={self.data.max_prompt_length} + max_response_length={self.max_response_length}",
        )
        self._check_data()
        self._check_resume()

    def _check_pretrain(self) -> None:
        """A missing `pretrain` directory is most often the SFT export not written yet: say how to write it."""
        path = self.pretrain
        if path and not path.startswith(TINY_SCHEME) and not Path(path).is_dir():
            raise ConfigError(
                f"pretrain={path!r} does not exist: DPO starts from a fine-tuned model; write the SFT export first "
                "(`roll-sft` writes <output_dir>/sft/model) or set pretrain to a model directory"
            )

    def _check_data(self) -> None:
        """The pair files read, map onto the columns and fit the lengths; training holds one batch of pairs."""
        data = self.data
        if data.train_file or data.eval_file:
            # Imported here: `datasets` takes seconds to import, and a config without data files never needs it.
            from roll.datasets.preference_dataset import load_preference_splits

            tokenizer = load_tokenizer(self.actor_train.model_args.model_name_or_path)
            train, _ = load_preference_splits(data, tokenizer, self.max_response_length)
            source = f"data.train_file={data.train_file!r}"
        else:
            train, _ = arithmetic_problems(seed=data.task_seed)
            source = "the built-in arithmetic pairs"
        if self.batch_size > len(train):
            raise ConfigError(
                f"batch_size={self.batch_size} is more than the {len(train)} training pairs of {source}; "
                "lower batch_size or add pairs"
            )

    def _check_resume(self) -> None:
        if not self.resume_from_checkpoint:
            return
        try:
            load_driver_state(self.checkpoint_root, self.resume_tag)
        except FileNotFoundError as exc:
            raise ConfigError(
                f"resume_from_checkpoint={self.resume_from_checkpoint!r}: {exc}; name a saved step (e.g. step_2) "
                "or leave it empty to start afresh"
            ) from exc

    @property
    def checkpoint_root(self) -> Path:
        """Where checkpoints are written (valid after `validate`)."""
        return Path(self.run_dir) / "checkpoints"

    @property
    def resume_tag(self) -> str | None:
        """The checkpoint tag `resume_from_checkpoint` names (None: the latest complete one)."""
        requested = self.resume_from_checkpoint
        return None if requested == "latest" else Path(requested).name

    @property
    def model_export_dir(self) -> str:
        """The export directory, defaulted under the run directory."""
        return self.export_dir or f"{self.run_dir}/model"
