"""Config of the reward-model pipeline: the model with its scalar head, the data (pairs or step-labelled responses),
the margin, schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.schema import ConfigError, check
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.pipeline_config import EXP_NAME
from roll.pipeline.base.preference_config import PreferenceRunConfig

# The reward_model worker of each data format: Bradley-Terry on pairs, per-step BCE on step-labelled responses.
WORKERS = {
    "pairs": "roll.pipeline.rm.rm_worker.RewardTrainWorker",
    "steps": "roll.pipeline.rm.prm_worker.ProcessRewardTrainWorker",
}


@dataclass
class RMConfig(PreferenceRunConfig):
    """Training of `reward_model`: on pairs (`data.format=pairs`), a one-output sequence-classification head by
    the Bradley-Terry loss, whose HF export serves RLVR as a reward cluster; on step-labelled responses
    (`data.format=steps`), a process reward model: a one-output token-classification head trained by binary
    cross-entropy at each step's separator."""

    exp_name: str = field(default="rm", metadata=check(EXP_NAME))
    # How far the chosen score must lead the rejected one before the loss fades: -log sigmoid(r_c - r_r - margin).
    margin: float = field(default=0.0, metadata=check(ge=0))
    reward_model: WorkerConfig = field(default_factory=WorkerConfig)

    def batch_plan(self) -> list[str]:
        """One step's arithmetic: examples -> rows -> ranks -> micro-batches."""
        role = self.reward_model
        args = role.training_args
        if self.data.format == "steps":
            return [
                f"step-labelled responses: {self.batch_size} per optimizer step = {self.batch_size} rows, each "
                f"scored at its steps' separators ({self.data.step_separator!r})",
                f"reward_model: {self.batch_size // role.dp_size} rows per rank on {role.dp_size} rank(s) -> "
                f"micro-batches of {args.per_device_train_batch_size} rows x {args.gradient_accumulation_steps} "
                f"accumulation; {self.max_steps} steps",
            ]
        rows = 2 * self.batch_size
        return [
            f"pairs: {self.batch_size} per optimizer step = {rows} rows (chosen and rejected side by side)",
            f"reward_model: {rows // role.dp_size} rows per rank on {role.dp_size} rank(s) -> micro-batches of "
            f"{args.per_device_train_batch_size} rows ({args.per_device_train_batch_size // 2} pairs, one forward "
            f"pass) x {args.gradient_accumulation_steps} accumulation; {self.max_steps} steps",
        ]

    def validate(self) -> None:
        """The data format and its worker and options; the role trains whole examples per micro-batch, one step is
        `batch_size` examples; then model, data, resume."""
        if self.data.format == "steps":
            why = "a process reward model starts from a trained reward model; write the RM export first"
            self.check_pretrain_written(why, "roll-rm", "rm")
        super().validate()
        self.check_format_fields()
        data_format, role = self.data.format, self.reward_model
        if data_format == "unpaired":
            raise ConfigError(
                "data.format=unpaired (labelled completions) trains with KTO (roll-dpo loss.loss_type=kto); "
                "the reward model takes data.format=pairs or steps"
            )
        other = WORKERS["pairs" if data_format == "steps" else "steps"]
        if role.worker_cls == other:
            raise ConfigError(
                f"reward_model.worker_cls={other} does not train on data.format={data_format}; set "
                f"reward_model.worker_cls={WORKERS[data_format]}"
            )
        if self.margin and data_format != "pairs":
            raise ConfigError(
                f"margin={self.margin} applies to data.format=pairs only, not {data_format}; leave it at 0"
            )
        self.check_example_training("reward_model", role)
        self.check_inputs([role])
