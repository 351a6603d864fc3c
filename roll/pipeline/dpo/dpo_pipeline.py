"""The DPO driver loop: the frozen reference scores a batch of pairs once, then the policy takes a preference step.

The policy (`actor_train`) and the reference take turns on shared devices (`Residency` offloads the
one a phase does not need), or run on devices of their own. Held-out preference accuracy, the
fraction of held-out pairs whose implicit reward ranks the chosen response first, is printed
before -> after; the trained policy is exported as a Hugging Face directory.
"""

from __future__ import annotations

import torch

from roll.datasets.preference_dataset import encode_pairs
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.dpo.dpo_config import DPOConfig
from roll.pipeline.preference_loop import PreferenceRunPipeline
from roll.pipeline.rlvr import phases
from roll.utils.dpo_losses import LENGTH_AVERAGED, ranking_accuracy, sequence_log_probs

# The policy scoring held-out pairs: only actor_train's states need to be resident.
EVAL_LOG_PROBS = phases.Phase("eval_log_probs", frozenset({"actor_train"}))


class DPOPipeline(PreferenceRunPipeline):
    """Direct preference optimisation of `actor_train` on chosen/rejected pairs against a frozen `reference`."""

    config: DPOConfig
    trained_role = "actor_train"
    progress_label = "dpo"

    def __init__(self, config: DPOConfig) -> None:
        super().__init__(config)
        self.average = config.loss.loss_type in LENGTH_AVERAGED
        for name in (self.trained_role, "reference"):
            self.start_cluster(name)
        for future in [cluster.initialize(blocking=False) for cluster in self.clusters.values()]:
            future.get()
        self.residency = phases.Residency(self.clusters, {name: role.devices for name, role in config.roles().items()})
        self.eval_reference: torch.Tensor | None = None

    def sequence_log_probs(self, role: str, batch: DataProto, phase: phases.Phase) -> torch.Tensor:
        """Each row's sequence log-prob under `role`'s model (summed, or averaged for length-averaged losses)."""
        self.residency.enter(phase)
        cluster = self.clusters[role]
        padded, pad = batch.pad_to_divisor(cluster.world_size)
        token_log_probs = cluster.compute_log_probs(padded).unpad(pad).batch["log_probs"]
        return sequence_log_probs(token_log_probs, batch.batch["response_mask"], self.average)

    def evaluate(self) -> dict[str, float]:
        """Held-out preference accuracy and reward margin of the policy's implicit reward, and how often the
        policy itself gives the chosen response the higher log-prob."""
        if self.eval_reference is None:  # the reference is frozen: its held-out scores are computed once
            self.eval_reference = self.sequence_log_probs("reference", self.eval_batch, phases.REFERENCE_LOG_PROBS)
        policy = self.sequence_log_probs(self.trained_role, self.eval_batch, EVAL_LOG_PROBS)
        rewards = self.config.loss.beta * (policy - self.eval_reference)
        return {
            "val/preference_accuracy": ranking_accuracy(rewards[0::2], rewards[1::2]).item(),
            "val/reward_margin": (rewards[0::2] - rewards[1::2]).mean().item(),
            "val/policy_ranking_accuracy": ranking_accuracy(policy[0::2], policy[1::2]).item(),
        }

    def step(self) -> dict[str, float]:
        """One preference step: the reference scores the batch, then the policy updates on it."""
        timings: dict[str, float] = {}
        batch = encode_pairs(self.sampler.next_batch(), self.pad_id)
        with self.residency.timed(phases.REFERENCE_LOG_PROBS, timings):
            reference = self.clusters["reference"].compute_log_probs(batch).rename("log_probs", "ref_log_probs")
        with self.residency.timed(phases.ACTOR_UPDATE, timings):
            metrics = self.clusters[self.trained_role].preference_step(batch.union(reference), self.config.loss)[0]
        # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
        return {f"actor/{key}": value for key, value in metrics.items()} | timings

    def enter_training(self) -> None:
        """The policy's states resident (the reference offloaded when they share devices)."""
        self.residency.enter(phases.ACTOR_UPDATE)

    def postfix(self, metrics: dict[str, float], evaluation: dict[str, float]) -> dict[str, str]:
        """Loss, reward margin and the latest held-out preference accuracy."""
        return {
            "loss": f"{metrics['actor/loss']:.3f}",
            "margin": f"{metrics['actor/rewards/margin']:.2f}",
            "val_acc": f"{evaluation['val/preference_accuracy']:.2f}",
        }

    def summarize(self, before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], str]:
        """Held-out preference accuracy, and the policy's own ranking accuracy, before and after."""
        summary = {
            "val_preference_accuracy_before": before["val/preference_accuracy"],
            "val_preference_accuracy_after": after["val/preference_accuracy"],
            "val_policy_ranking_accuracy_before": before["val/policy_ranking_accuracy"],
            "val_policy_ranking_accuracy_after": after["val/policy_ranking_accuracy"],
        }
        line = (
            f"held-out preference accuracy {before['val/preference_accuracy']:.2f} -> "
            f"{after['val/preference_accuracy']:.2f} (policy ranks the chosen response first: "
            f"{before['val/policy_ranking_accuracy']:.2f} -> {after['val/policy_ranking_accuracy']:.2f})"
        )
        return summary, line
