"""What the configs of step-by-step training runs share: schedule, lengths, checkpoints, resume and export.

The base of the preference-pair configs (DPO, reward model) and of distillation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.data_config import SourceArguments
from roll.configs.model_dir import ModelFacts
from roll.configs.schema import ConfigError, any_value, check, checked_in_validate
from roll.configs.worker_config import WorkerConfig
from roll.distributed.strategy.registry import strategy_class
from roll.pipeline.base.fault_tolerance_config import FaultToleranceArguments
from roll.pipeline.base.pipeline_config import PipelineConfig
from roll.pipeline.base.resumable import ResumableRun


@dataclass
class TrainingRunConfig(ResumableRun, PipelineConfig):
    """A run of `max_steps` optimizer steps of `batch_size` training examples, evaluated on held-out examples,
    checkpointed (resumable) and exported as a Hugging Face directory."""

    pretrain: str = field(
        default="", metadata=any_value("only interpolated (${pretrain}) into model paths, which validate() checks")
    )
    max_steps: int = field(default=100, metadata=check(ge=1))
    # Training examples (preference pairs, demonstrations) per optimizer step over all ranks.
    batch_size: int = field(default=32, metadata=check(ge=1))
    # Held-out evaluation every N steps (and before the first and after the last).
    eval_steps: int = field(default=25, metadata=check(ge=1))
    eval_batch_size: int = field(default=0, metadata=check(ge=0, hint="0 evaluates every held-out example"))
    save_steps: int = field(default=0, metadata=check(ge=0, hint="0 saves only at the end"))
    # Checkpoints kept on disk: the newest N complete ones (the latest always); 0 keeps every one.
    keep_last_n: int = field(default=0, metadata=check(ge=0, hint="0 keeps every checkpoint"))
    # Restarts after a lost worker or node, and the stop on SIGTERM/SIGINT (docs/fault_tolerance.md).
    fault_tolerance: FaultToleranceArguments = field(default_factory=FaultToleranceArguments)
    # A checkpoint directory, or "latest" under run_dir/checkpoints, or "auto" (latest if there is one, else afresh).
    resume_from_checkpoint: str = field(
        default="", metadata=checked_in_validate("whether the checkpoint exists is the filesystem's", "step_999999")
    )
    max_response_length: int = field(default=8, metadata=check(ge=1))
    export_dir: str = field(
        default="", metadata=any_value("any directory to write the model to; empty = <run_dir>/model")
    )
    data: SourceArguments = field(default_factory=SourceArguments)

    def sequence_lengths(self) -> tuple[int, int, int | None]:
        """The longest prompt and the longest response."""
        return self.data.max_prompt_length, self.max_response_length, None

    @staticmethod
    def check_trains(name: str, role: WorkerConfig) -> None:
        """Role `name` runs a training strategy."""
        strategy = role.strategy_args.strategy_name if role.strategy_args else None
        if strategy is None or not strategy_class(strategy).trains():
            raise ConfigError(
                f"{name}.strategy_args.strategy_name={strategy} does not train; use deepspeed_train or fsdp2_train"
            )

    def check_models_and_lengths(self, roles: list[WorkerConfig]) -> dict[str, ModelFacts]:
        """The roles' models parse and a prompt plus a response fits each; their sizes by role name."""
        facts = self.check_models(roles)
        tokens = self.data.max_prompt_length + self.max_response_length
        self.check_lengths(
            facts,
            tokens,
            f"data.max_prompt_length={self.data.max_prompt_length} + max_response_length={self.max_response_length}",
        )
        return facts
