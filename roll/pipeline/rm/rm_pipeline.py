"""The reward-model driver: Bradley-Terry steps on pairs, or a process reward model's steps on step-labelled
responses; held-out accuracy before -> after, HF export.

Pairs: held-out pairwise accuracy, the fraction of held-out pairs whose chosen response the model
scores higher. The export loads with AutoModelForSequenceClassification and serves RLVR as a reward
cluster (`roll.pipeline.base.reward_model_worker.RewardModelWorker`).
Steps (`data.format=steps`): held-out step accuracy, the fraction of steps whose correctness the
score at their separator gets right, and the fraction of responses with a wrong step whose first
wrong step is the first one scored wrong. The export loads with AutoModelForTokenClassification.
"""

from __future__ import annotations

from roll.algorithms.preference_losses import ranking_accuracy
from roll.algorithms.process_reward_losses import first_error_found, step_accuracy, step_bce_loss
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.preference_loop import PreferenceRunPipeline
from roll.pipeline.base.training_loop import before_after_summary, progress_postfix
from roll.pipeline.rm.rm_config import RMConfig


class RMPipeline(PreferenceRunPipeline):
    """Trains `reward_model` to score each pair's chosen response above its rejected one, or (data.format=steps)
    each step of a response by whether it is correct."""

    config: RMConfig
    trained_role = "reward_model"
    progress_label = "rm"

    def __init__(self, config: RMConfig) -> None:
        super().__init__(config)
        self.process = config.data.format == "steps"
        with self.released_on_failure():
            self.cluster = self.start_cluster(self.trained_role)
            self.cluster.initialize()

    def scores(self, batch: DataProto) -> DataProto:
        """The reward model's score of every row of `batch` (`scores`), or of every response token (`step_scores`)
        for a process reward model."""
        padded, pad = batch.pad_to_divisor(self.cluster.world_size)
        scored = self.cluster.compute_step_scores(padded) if self.process else self.cluster.compute_scores(padded)
        return scored.unpad(pad)

    def evaluate(self) -> dict[str, float]:
        """Pairs: held-out pairwise accuracy (a tie counts half) and the mean score gap of chosen over rejected.
        Steps: held-out step accuracy, the fraction of first errors found and the step loss."""
        if self.process:
            scores = self.scores(self.eval_batch).batch["step_scores"]
            labels, mask = self.eval_batch.batch["step_labels"], self.eval_batch.batch["step_mask"]
            return {
                "val/step_accuracy": step_accuracy(scores, labels, mask).item(),
                "val/first_error_found": first_error_found(scores, labels, mask).item(),
                "val/step_loss": step_bce_loss(scores, labels, mask).item(),
            }
        scores = self.scores(self.eval_batch).batch["scores"]
        chosen, rejected = scores[0::2], scores[1::2]
        return {
            "val/preference_accuracy": ranking_accuracy(chosen, rejected).item(),
            "val/reward_margin": (chosen - rejected).mean().item(),
        }

    def step(self) -> dict[str, float]:
        """One step on the next batch: Bradley-Terry on pairs, or per-step BCE on step-labelled responses."""
        batch = self.encode(self.sampler.next_batch())
        if self.process:
            metrics = self.cluster.process_reward_step(batch)[0]
        else:
            metrics = self.cluster.reward_pair_step(batch, self.config.margin)[0]
        # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
        return {f"reward_model/{key}": value for key, value in metrics.items()}

    def postfix(self, metrics: dict[str, float], evaluation: dict[str, float]) -> dict[str, str]:
        """Loss, batch accuracy and the latest held-out accuracy."""
        accuracy, held_out = (
            ("step_accuracy", "val/step_accuracy") if self.process else ("accuracy", "val/preference_accuracy")
        )
        batch_accuracy = metrics[f"reward_model/{accuracy}"]
        return progress_postfix(metrics["reward_model/loss"], evaluation[held_out], acc=f"{batch_accuracy:.2f}")

    def summarize(self, before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], str]:
        """Held-out pairwise accuracy before and after; for steps, step accuracy and first errors found."""
        if self.process:
            summary = before_after_summary(before, after, "step_accuracy", "first_error_found")
            line = (
                f"held-out step accuracy {before['val/step_accuracy']:.2f} -> {after['val/step_accuracy']:.2f} "
                f"(first wrong step found in {before['val/first_error_found']:.2f} -> "
                f"{after['val/first_error_found']:.2f} of the responses with one)"
            )
            return summary, line
        accuracy = before["val/preference_accuracy"], after["val/preference_accuracy"]
        summary = {"val_pairwise_accuracy_before": accuracy[0], "val_pairwise_accuracy_after": accuracy[1]}
        return summary, f"held-out pairwise accuracy {accuracy[0]:.2f} -> {accuracy[1]:.2f}"
