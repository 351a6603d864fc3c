"""Config of the SFT pipeline: one training role, demonstrations, schedule and export."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.data_config import DataArguments
from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base_config import PipelineConfig


@dataclass
class SFTConfig(PipelineConfig):
    """Supervised fine-tuning on (prompt, answer) pairs; the result is exported as a HF directory."""

    exp_name: str = "sft"
    max_steps: int = 300
    batch_size: int = 64  # demonstrations per optimizer step over all ranks
    eval_steps: int = 100
    max_response_length: int = 8
    export_dir: str = ""  # where the trained model is written; empty = <output_dir>/<exp_name>/model
    skip_if_exported: bool = False  # a finished export in export_dir is reused instead of retraining
    data: DataArguments = field(default_factory=DataArguments)
    actor_train: WorkerConfig = field(default_factory=WorkerConfig)

    def validate(self) -> None:
        """Roles, then that one step's batch is whole micro-batches on every rank."""
        super().validate()
        args = self.actor_train.training_args
        step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.actor_train.dp_size
        if self.batch_size != step_rows:
            raise ConfigError(
                f"batch_size={self.batch_size} must equal actor_train per_device_train_batch_size x "
                f"gradient_accumulation_steps x dp size = {step_rows}"
            )

    @property
    def model_export_dir(self) -> str:
        """The export directory, defaulted under the output directory."""
        return self.export_dir or f"{self.output_dir}/{self.exp_name}/model"
