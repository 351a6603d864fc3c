"""The reward-model driver: Bradley-Terry steps on preference pairs, held-out pairwise accuracy, HF export.

Held-out pairwise accuracy, the fraction of held-out pairs whose chosen response the model scores
higher, is printed before -> after. The export loads with AutoModelForSequenceClassification and
serves RLVR as a reward cluster (`roll.pipeline.rlvr.reward_model_worker.RewardModelWorker`).
"""

from __future__ import annotations

from roll.datasets.preference_dataset import encode_pairs
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.preference_loop import PreferenceRunPipeline
from roll.pipeline.rm.rm_config import RMConfig
from roll.utils.dpo_losses import ranking_accuracy


class RMPipeline(PreferenceRunPipeline):
    """Trains `reward_model` to score each pair's chosen response above its rejected one."""

    config: RMConfig
    trained_role = "reward_model"
    progress_label = "rm"

    def __init__(self, config: RMConfig) -> None:
        super().__init__(config)
        self.cluster = self.start_cluster(self.trained_role)
        self.cluster.initialize()

    def scores(self, batch: DataProto) -> DataProto:
        """The reward model's score of every row of `batch`."""
        padded, pad = batch.pad_to_divisor(self.cluster.world_size)
        return self.cluster.compute_scores(padded).unpad(pad)

    def evaluate(self) -> dict[str, float]:
        """Held-out pairwise accuracy (a tie counts half) and the mean score gap of chosen over rejected."""
        scores = self.scores(self.eval_batch).batch["scores"]
        chosen, rejected = scores[0::2], scores[1::2]
        return {
            "val/preference_accuracy": ranking_accuracy(chosen, rejected).item(),
            "val/reward_margin": (chosen - rejected).mean().item(),
        }

    def step(self) -> dict[str, float]:
        """One Bradley-Terry step on the next batch of pairs."""
        batch = encode_pairs(self.sampler.next_batch(), self.pad_id)
        metrics = self.cluster.reward_pair_step(batch, self.config.margin)[0]
        # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
        return {f"reward_model/{key}": value for key, value in metrics.items()}

    def postfix(self, metrics: dict[str, float], evaluation: dict[str, float]) -> dict[str, str]:
        """Loss, batch accuracy and the latest held-out accuracy."""
        return {
            "loss": f"{metrics['reward_model/loss']:.3f}",
            "acc": f"{metrics['reward_model/accuracy']:.2f}",
            "val_acc": f"{evaluation['val/preference_accuracy']:.2f}",
        }

    def summarize(self, before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], str]:
        """Held-out pairwise accuracy before and after."""
        accuracy = before["val/preference_accuracy"], after["val/preference_accuracy"]
        summary = {"val_pairwise_accuracy_before": accuracy[0], "val_pairwise_accuracy_after": accuracy[1]}
        return summary, f"held-out pairwise accuracy {accuracy[0]:.2f} -> {accuracy[1]:.2f}"
