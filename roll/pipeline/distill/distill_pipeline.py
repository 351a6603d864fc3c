"""The offline distillation driver: the teacher scores a batch of demonstrations, then the student learns from it.

Each step the frozen `teacher` gives its top-k log-probs at every response position of a batch of
demonstrations, and the `student` takes one optimizer step on the divergence from them
(`roll.algorithms.distillation_losses`). The two take turns on shared devices (`Residency` offloads the one a
phase does not need) or run on devices of their own. The student's greedy held-out accuracy is
printed before -> after, beside the teacher's; the student is exported as a Hugging Face directory.
"""

from __future__ import annotations

from roll.configs.worker_config import GeneratingArguments
from roll.datasets.prompt_dataset import encode_demonstrations, load_splits, make_sampler, pad_token_id
from roll.models.model_providers import load_tokenizer
from roll.pipeline.base.evaluation import answer_scorer, greedy_accuracy
from roll.pipeline.base.residency import Phase, phase
from roll.pipeline.base.rl_workers import MAX_RESPONSE_LENGTH
from roll.pipeline.base.teacher_checks import shared_vocab_size
from roll.pipeline.base.training_loop import TrainingRunPipeline, before_after_summary, progress_postfix
from roll.pipeline.distill.distill_config import DistillConfig

TEACHER_TOP_K = phase("teacher_top_k", "teacher")
STUDENT_UPDATE = phase("student_update", "student")


class DistillPipeline(TrainingRunPipeline):
    """Trains `student` towards the frozen `teacher`'s top-k distribution on demonstrations."""

    config: DistillConfig
    trained_role = "student"
    progress_label = "distill"
    training_phase = STUDENT_UPDATE

    def __init__(self, config: DistillConfig) -> None:
        super().__init__(config)
        tokenizer = load_tokenizer(config.student.model_args.model_name_or_path)
        self.pad_id = pad_token_id(tokenizer)
        self.score = answer_scorer(tokenizer)
        train, held_out = load_splits(config.data, tokenizer, config.max_response_length)
        self.sampler = make_sampler(train, config.batch_size, config.seed, config.data.domain_weights)
        self.eval_examples = held_out[: config.eval_batch_size or None]
        self.generating_args = GeneratingArguments(max_new_tokens=config.max_response_length)
        self.vocab_size = shared_vocab_size(config.teacher, config.student)
        self.start_roles(("teacher", "student"))
        self.teacher_accuracy: float | None = None  # the teacher is frozen: evaluated once

    def accuracy(self, role: str, phase: Phase) -> float:
        """Greedy held-out accuracy of `role`'s model."""
        self.residency.enter(phase)
        return greedy_accuracy(self.clusters[role], self.eval_examples, self.pad_id, self.generating_args, self.score)[
            0
        ]

    def evaluate(self) -> dict[str, float]:
        """The student's greedy held-out accuracy, and the teacher's beside it."""
        if self.teacher_accuracy is None:
            self.teacher_accuracy = self.accuracy("teacher", TEACHER_TOP_K)
        return {"val/accuracy": self.accuracy("student", STUDENT_UPDATE), "val/teacher_accuracy": self.teacher_accuracy}

    def step(self) -> dict[str, float]:
        """One distillation step: the teacher's top-k on the next batch, then the student's update on it."""
        config, timings = self.config, {}
        batch = encode_demonstrations(self.sampler.next_batch(), self.pad_id)
        batch.meta_info[MAX_RESPONSE_LENGTH] = config.max_response_length
        with self.residency.timed(TEACHER_TOP_K, timings):
            teacher = self.clusters["teacher"]
            padded, pad = batch.pad_to_divisor(teacher.world_size)
            top_k = teacher.compute_top_k_log_probs(padded, config.top_k, self.vocab_size).unpad(pad)
        with self.residency.timed(STUDENT_UPDATE, timings):
            metrics = self.clusters["student"].distill_step(batch.union(top_k), config.loss)[0]
        # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
        return {f"student/{key}": value for key, value in metrics.items()} | timings

    def postfix(self, metrics: dict[str, float], evaluation: dict[str, float]) -> dict[str, str]:
        """Loss, the divergence term and the latest held-out accuracy."""
        return progress_postfix(metrics["student/loss"], evaluation["val/accuracy"], kl=f"{metrics['student/kl']:.3f}")

    def summarize(self, before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], str]:
        """The student's held-out accuracy before and after, and the teacher's."""
        teacher = after["val/teacher_accuracy"]
        summary = before_after_summary(before, after, "accuracy") | {"teacher_val_accuracy": teacher}
        line = (
            f"held-out accuracy: student {summary['val_accuracy_before']:.2f} -> {summary['val_accuracy_after']:.2f}, "
            f"teacher {summary['teacher_val_accuracy']:.2f}"
        )
        return summary, line
