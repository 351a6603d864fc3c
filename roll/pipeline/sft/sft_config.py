"""Config of the SFT pipeline: one training role, demonstrations, schedule and export."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.data_config import DataArguments
from roll.configs.schema import ConfigError, any_value, check
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.pipeline_config import EXP_NAME, PipelineConfig


@dataclass
class SFTConfig(PipelineConfig):
    """Supervised fine-tuning on (prompt, answer) pairs; the result is exported as a HF directory."""

    exp_name: str = field(default="sft", metadata=check(EXP_NAME))
    max_steps: int = field(default=300, metadata=check(ge=1))
    # Demonstrations per optimizer step over all ranks.
    batch_size: int = field(default=64, metadata=check(ge=1))
    eval_steps: int = field(default=100, metadata=check(ge=1))
    max_response_length: int = field(default=8, metadata=check(ge=1))
    export_dir: str = field(
        default="", metadata=any_value("any directory to write the model to; empty = <run_dir>/model")
    )
    skip_if_exported: bool = False  # a finished export in export_dir is reused instead of retraining
    data: DataArguments = field(default_factory=DataArguments)
    actor_train: WorkerConfig = field(default_factory=WorkerConfig)

    def batch_plan(self) -> list[str]:
        """One SFT step's arithmetic: demonstrations per step -> ranks -> micro-batches."""
        args, role = self.actor_train.training_args, self.actor_train
        return [
            f"actor_train: {self.batch_size} demonstrations per optimizer step = {role.dp_size} rank(s) x "
            f"micro-batches of {args.per_device_train_batch_size} x {args.gradient_accumulation_steps} "
            f"accumulation; {self.max_steps} steps"
        ]

    def sequence_lengths(self) -> tuple[int, int, int | None]:
        """The longest prompt and the longest demonstrated response."""
        return self.data.max_prompt_length, self.max_response_length, None

    def validate(self) -> None:
        """Roles, that one step's batch is whole micro-batches on every rank, then the model, data and memory."""
        super().validate()
        args = self.actor_train.training_args
        step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.actor_train.dp_size
        if self.batch_size != step_rows:
            raise ConfigError(
                f"batch_size={self.batch_size} must equal actor_train per_device_train_batch_size x "
                f"gradient_accumulation_steps x dp size = {step_rows}"
            )
        actor = self.actor_train
        model = self.check_models([actor])["actor_train"]
        tokens = self.data.max_prompt_length + self.max_response_length
        self.check_lengths(
            {"actor_train": model},
            tokens,
            f"data.max_prompt_length={self.data.max_prompt_length} + max_response_length={self.max_response_length}",
        )
        _, held_out = self.check_data(
            self.data, self.batch_size, "batch_size", actor.model_args.model_name_or_path, self.max_response_length
        )
        lower = "max_response_length or actor_train.infer_batch_size"
        self.check_generation_memory(actor, model, len(held_out), 1, tokens, lower)  # the greedy evaluation

    @property
    def model_export_dir(self) -> str:
        """The export directory, defaulted under the run directory."""
        return self.export_dir or f"{self.run_dir}/model"
