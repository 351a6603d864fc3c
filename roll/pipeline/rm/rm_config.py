"""Config of the reward-model pipeline: the model with its scalar head, preference pairs, the margin, schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.data_config import PreferenceDataArguments
from roll.configs.schema import ConfigError, any_value, check, checked_in_validate
from roll.configs.worker_config import WorkerConfig
from roll.datasets.arithmetic import arithmetic_problems
from roll.distributed.strategy.registry import strategy_class
from roll.models.model_providers import load_tokenizer
from roll.pipeline.base_config import EXP_NAME, PipelineConfig
from roll.pipeline.resumable import ResumableRun


@dataclass
class RMConfig(ResumableRun, PipelineConfig):
    """Bradley-Terry training of `reward_model` (a one-output head on the backbone); the result is a HF export
    that loads with AutoModelForSequenceClassification and serves RLVR as a reward cluster."""

    exp_name: str = field(default="rm", metadata=check(EXP_NAME))
    pretrain: str = field(
        default="", metadata=any_value("only interpolated (${pretrain}) into model paths, which validate() checks")
    )
    max_steps: int = field(default=100, metadata=check(ge=1))
    # Preference pairs per optimizer step over all ranks (each pair is two rows: chosen and rejected).
    batch_size: int = field(default=32, metadata=check(ge=1))
    # Held-out pairwise accuracy every N steps (and before the first and after the last).
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
    # How far the chosen score must lead the rejected one before the loss fades: -log sigmoid(r_c - r_r - margin).
    margin: float = field(default=0.0, metadata=check(ge=0))
    data: PreferenceDataArguments = field(default_factory=PreferenceDataArguments)
    reward_model: WorkerConfig = field(default_factory=WorkerConfig)

    def batch_plan(self) -> list[str]:
        """One step's arithmetic: pairs -> rows -> ranks -> micro-batches."""
        rows, role = 2 * self.batch_size, self.reward_model
        args = role.training_args
        return [
            f"pairs: {self.batch_size} per optimizer step = {rows} rows (chosen and rejected side by side)",
            f"reward_model: {rows // role.dp_size} rows per rank on {role.dp_size} rank(s) -> micro-batches of "
            f"{args.per_device_train_batch_size} rows ({args.per_device_train_batch_size // 2} pairs, one forward "
            f"pass) x {args.gradient_accumulation_steps} accumulation; {self.max_steps} steps",
        ]

    def sequence_lengths(self) -> tuple[int, int, int | None]:
        """The longest prompt and the longest response."""
        return self.data.max_prompt_length, self.max_response_length, None

    def validate(self) -> None:
        """The role trains whole pairs per micro-batch, one step is `batch_size` pairs; then model, data, resume."""
        super().validate()
        role = self.reward_model
        strategy = role.strategy_args.strategy_name if role.strategy_args else None
        if strategy is None or not strategy_class(strategy).trains():
            raise ConfigError(
                f"reward_model.strategy_args.strategy_name={strategy} does not train; use deepspeed_train"
            )
        args = role.training_args
        if args.per_device_train_batch_size % 2:
            raise ConfigError(
                f"reward_model.training_args.per_device_train_batch_size={args.per_device_train_batch_size} must be "
                "even: a micro-batch holds whole pairs (a chosen and a rejected row each)"
            )
        if role.max_tokens_per_microbatch is not None:
            raise ConfigError(
                "reward_model.max_tokens_per_microbatch must be null: a token budget regroups (or packs) rows, which "
                "would split a pair over micro-batches and move the score off each row's last token"
            )
        step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * role.dp_size
        if 2 * self.batch_size != step_rows:
            raise ConfigError(
                f"batch_size={self.batch_size} pairs are {2 * self.batch_size} rows, which must equal reward_model "
                f"per_device_train_batch_size x gradient_accumulation_steps x dp size = {step_rows}"
            )
        facts = self.check_models([role])
        tokens = self.data.max_prompt_length + self.max_response_length
        self.check_lengths(
            facts,
            tokens,
            f"data.max_prompt_length={self.data.max_prompt_length} + max_response_length={self.max_response_length}",
        )
        self._check_data()
        self.check_resume()

    def _check_data(self) -> None:
        """The pair files read, map onto the columns and fit the lengths; training holds one batch of pairs."""
        data = self.data
        if data.train_file or data.eval_file:
            # Imported here: `datasets` takes seconds to import, and a config without data files never needs it.
            from roll.datasets.preference_dataset import load_preference_splits

            tokenizer = load_tokenizer(self.reward_model.model_args.model_name_or_path)
            pairs = len(load_preference_splits(data, tokenizer, self.max_response_length)[0])
            source = f"data.train_file={data.train_file!r}"
        else:
            pairs, source = len(arithmetic_problems(seed=data.task_seed)[0]), "the built-in arithmetic pairs"
        if self.batch_size > pairs:
            raise ConfigError(
                f"batch_size={self.batch_size} is more than the {pairs} training pairs of {source}; "
                "lower batch_size or add pairs"
            )
