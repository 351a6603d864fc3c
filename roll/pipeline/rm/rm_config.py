"""Config of the reward-model pipeline: the model with its scalar head, preference pairs, the margin, schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.schema import ConfigError, check
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base_config import EXP_NAME
from roll.pipeline.preference_config import PreferenceRunConfig


@dataclass
class RMConfig(PreferenceRunConfig):
    """Bradley-Terry training of `reward_model` (a one-output head on the backbone); the result is a HF export
    that loads with AutoModelForSequenceClassification and serves RLVR as a reward cluster."""

    exp_name: str = field(default="rm", metadata=check(EXP_NAME))
    # How far the chosen score must lead the rejected one before the loss fades: -log sigmoid(r_c - r_r - margin).
    margin: float = field(default=0.0, metadata=check(ge=0))
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

    def validate(self) -> None:
        """The role trains whole pairs per micro-batch, one step is `batch_size` pairs; then model, data, resume."""
        super().validate()
        self.check_format_fields()
        if self.data.format == "unpaired":
            raise ConfigError(
                "data.format=unpaired (labelled completions) trains with KTO (roll-dpo loss.loss_type=kto); "
                "the reward model takes data.format=pairs"
            )
        role = self.reward_model
        self.check_example_training("reward_model", role)
        self.check_inputs([role])
