"""Config of the offline distillation pipeline: a frozen teacher, a trained student, demonstrations and the loss."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.algorithms.distillation_losses import DivergenceKind, Support
from roll.algorithms.policy_losses import AggMode
from roll.configs.data_config import DataArguments
from roll.configs.schema import ConfigError, check
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.pipeline_config import EXP_NAME
from roll.pipeline.base.teacher_checks import (
    check_same_vocabulary,
    check_teacher_model,
    check_teacher_strategy,
    fit_teacher_top_k,
    scores_on_engine,
    shared_vocab_size,
)
from roll.pipeline.base.training_config import TrainingRunConfig


@dataclass
class DistillLossArguments:
    """The student's loss on the teacher's top-k tokens (`roll.algorithms.distillation_losses`): forward KL,
    reverse KL, or `forward_weight` x forward + (1 - forward_weight) x reverse (`mixed`), on the top-k `support`
    renormalized or with a tail bucket, plus `nll_weight` x the demonstration's negative log-likelihood."""

    kind: DivergenceKind = "forward"
    # mixed only: the forward KL's share.
    forward_weight: float = field(default=0.5, metadata=check(gt=0, lt=1))
    support: Support = "tail"
    nll_weight: float = field(default=0.0, metadata=check(ge=0))
    agg_mode: AggMode = "token-mean"


@dataclass
class DistillConfig(TrainingRunConfig):
    """Offline knowledge distillation: `student` (trained) learns the `teacher`'s (frozen) top-k distribution at
    each position of the demonstrations' responses; the result is a HF export."""

    exp_name: str = field(default="distill", metadata=check(EXP_NAME))
    # Tokens per response position whose teacher log-probs the student learns.
    top_k: int = field(default=8, metadata=check(ge=1))
    data: DataArguments = field(default_factory=DataArguments)
    loss: DistillLossArguments = field(default_factory=DistillLossArguments)
    teacher: WorkerConfig = field(default_factory=WorkerConfig)
    student: WorkerConfig = field(default_factory=WorkerConfig)

    def batch_plan(self) -> list[str]:
        """One step's arithmetic: the teacher's forward passes, then the student's micro-batches."""
        teacher, student = self.teacher, self.student
        args, shard = student.training_args, -(-self.batch_size // teacher.dp_size)
        scoring = (
            "by the engine's prompt log-probs"
            if scores_on_engine(teacher)
            else f"in forward passes of {teacher.infer_batch_size}"
        )
        return [
            f"teacher: {shard} demonstrations per rank on {teacher.dp_size} rank(s) {scoring}, "
            f"top {self.top_k} log-probs per response token",
            f"student: {self.batch_size} demonstrations per optimizer step = {student.dp_size} rank(s) x "
            f"micro-batches of {args.per_device_train_batch_size} x {args.gradient_accumulation_steps} accumulation; "
            f"{self.max_steps} steps",
        ]

    def validate(self) -> None:
        """Roles (a frozen teacher scoring sequences, a trained student of its tokenizer), one step's rows, the loss
        options, then models, lengths, data, memory and the checkpoint to resume from."""
        check_teacher_model("teacher", self.teacher)
        super().validate()
        teacher, student = self.teacher, self.student
        check_teacher_strategy(teacher)
        self.check_trains("student", student)
        args = student.training_args
        step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * student.dp_size
        if self.batch_size != step_rows:
            raise ConfigError(
                f"batch_size={self.batch_size} must equal student per_device_train_batch_size x "
                f"gradient_accumulation_steps x dp size = {step_rows}"
            )
        if self.loss.forward_weight != 0.5 and self.loss.kind != "mixed":
            raise ConfigError(
                f"loss.forward_weight={self.loss.forward_weight} applies to loss.kind=mixed only, not "
                f"{self.loss.kind}; leave it at 0.5"
            )
        facts = self.check_models_and_lengths([teacher, student])
        check_same_vocabulary(teacher, student)
        vocab = shared_vocab_size(teacher, student)
        if vocab is not None and self.top_k > vocab:
            raise ConfigError(f"top_k={self.top_k} is more than the models' {vocab} tokens; lower top_k")
        fit_teacher_top_k(teacher, student, self.top_k)
        _, held_out = self.check_data(
            self.data, self.batch_size, "batch_size", student.model_args.model_name_or_path, self.max_response_length
        )
        evaluated = min(len(held_out), self.eval_batch_size or len(held_out))
        tokens = self.data.max_prompt_length + self.max_response_length
        for name, role in (("teacher", teacher), ("student", student)):
            lower = f"max_response_length, eval_batch_size or {name}.infer_batch_size"
            self.check_generation_memory(role, facts[name], evaluated, 1, tokens, lower)  # the greedy evaluation
        self.check_resume()
