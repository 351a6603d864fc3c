"""The DPO driver loop: the frozen reference scores a batch once, then the policy takes a preference step.

The policy (`actor_train`) and the reference take turns on shared devices (`Residency` offloads the
one a phase does not need), or run on devices of their own. A batch is pairs (DPO, IPO, or KTO reading
them unpaired) or labelled completions (`data.format=unpaired`, KTO). KTO's reference point is
estimated each step on mismatched rows (each prompt with another row's completion), scored by both
models before the update. The held-out accuracy of the implicit reward is printed before -> after;
the trained policy is exported as a Hugging Face directory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from roll.algorithms.preference_losses import LENGTH_AVERAGED, kto_reference_point, ranking_accuracy, sequence_log_probs
from roll.datasets.prompt_dataset import encode_demonstrations
from roll.datasets.unpaired_dataset import encode_labelled, mismatched_examples, pairs_unpaired, require_both_labels
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.preference_loop import PreferenceRunPipeline
from roll.pipeline.base.residency import Phase, phase
from roll.pipeline.base.training_loop import before_after_summary, progress_postfix
from roll.pipeline.dpo.dpo_config import DPOConfig
from roll.pipeline.dpo.dpo_worker import kto_class_metrics

logger = logging.getLogger(__name__)
REFERENCE_LOG_PROBS = phase("reference_log_probs", "reference")
POLICY_UPDATE = phase("actor_update", "actor_train")
# The policy scoring held-out rows: only actor_train's states need to be resident.
EVAL_LOG_PROBS = phase("eval_log_probs", "actor_train")


class DPOPipeline(PreferenceRunPipeline):
    """Preference optimisation of `actor_train` against a frozen `reference`: DPO/IPO on pairs, KTO on labelled
    completions or on pairs read unpaired."""

    config: DPOConfig
    trained_role = "actor_train"
    progress_label = "dpo"
    training_phase = POLICY_UPDATE

    def __init__(self, config: DPOConfig) -> None:
        super().__init__(config)
        self.average = config.loss.loss_type in LENGTH_AVERAGED
        self.unpaired = config.data.format == "unpaired"
        if self.unpaired:
            self._check_held_out_classes()
        self.start_roles((self.trained_role, "reference"))
        self.eval_reference: torch.Tensor | None = None

    def _check_held_out_classes(self) -> None:
        """The held-out accuracy compares desirable with undesirable completions: both must be there."""
        data = self.config.data
        source = f"data.eval_file={data.eval_file!r}" if data.eval_file else "the built-in held-out completions"
        require_both_labels(
            self.eval_batch.batch["desirable"], f"{source} (eval_batch_size={self.config.eval_batch_size})"
        )

    def sequence_log_probs(self, role: str, batch: DataProto, phase: Phase | None = None) -> torch.Tensor:
        """Each row's sequence log-prob under `role`'s model (summed, or averaged for length-averaged losses),
        after entering `phase` when given."""
        if phase is not None:
            self.residency.enter(phase)
        cluster = self.clusters[role]
        padded, pad = batch.pad_to_divisor(cluster.world_size)
        token_log_probs = cluster.compute_log_probs(padded).unpad(pad).batch["log_probs"]
        return sequence_log_probs(token_log_probs, batch.batch["response_mask"], self.average)

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy and margin of the policy's implicit reward, and the same accuracy of the policy's own
        log-prob. Pairs: the fraction ranking the chosen response first. Unpaired: the fraction of every
        (desirable, undesirable) pair of held-out rows ranked so (the reward's AUC). A tie counts half."""
        if self.eval_reference is None:  # the reference is frozen: its held-out scores are computed once
            self.eval_reference = self.sequence_log_probs("reference", self.eval_batch, REFERENCE_LOG_PROBS)
        policy = self.sequence_log_probs(self.trained_role, self.eval_batch, EVAL_LOG_PROBS)
        rewards = self.config.loss.beta * (policy - self.eval_reference)
        if self.unpaired:
            good = self.eval_batch.batch["desirable"]
            first, second = (
                (rewards[good][:, None], rewards[~good][None, :]),
                (policy[good][:, None], policy[~good][None, :]),
            )
        else:
            first, second = (rewards[0::2], rewards[1::2]), (policy[0::2], policy[1::2])
        return {
            "val/preference_accuracy": ranking_accuracy(*first).item(),
            "val/reward_margin": (first[0].mean() - first[1].mean()).item(),
            "val/policy_ranking_accuracy": ranking_accuracy(*second).item(),
        }

    def step(self) -> dict[str, float]:
        """One preference step: the reference scores the batch, then the policy updates on it."""
        examples = self.sampler.next_batch()
        if self.config.loss.loss_type == "kto":
            return self.kto_step(examples)
        timings: dict[str, float] = {}
        batch = self.encode(examples)
        with self.residency.timed(REFERENCE_LOG_PROBS, timings):
            reference = self.clusters["reference"].compute_log_probs(batch).rename("log_probs", "ref_log_probs")
        with self.residency.timed(POLICY_UPDATE, timings):
            metrics = self.clusters[self.trained_role].preference_step(batch.union(reference), self.config.loss)[0]
        # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
        return {f"actor/{key}": value for key, value in metrics.items()} | timings

    def kto_step(self, examples: Sequence[Any]) -> dict[str, float]:
        """One KTO step: both models score the rows and their mismatched rows (the reference point z0 is their
        mean log-ratio, clamped at 0), then the policy updates on the rows."""
        timings: dict[str, float] = {}
        rows = examples if self.unpaired else pairs_unpaired(examples)
        batch = encode_labelled(rows, self.pad_id)
        mismatched = encode_demonstrations(mismatched_examples([row.example for row in rows]), self.pad_id)
        with self.residency.timed(REFERENCE_LOG_PROBS, timings):
            reference = self.clusters["reference"].compute_log_probs(batch).rename("log_probs", "ref_log_probs")
            reference_mismatched = self.sequence_log_probs("reference", mismatched)
        with self.residency.timed(POLICY_UPDATE, timings):
            policy_mismatched = self.sequence_log_probs(self.trained_role, mismatched)
            point = kto_reference_point(policy_mismatched, reference_mismatched)
            cluster = self.clusters[self.trained_role]
            metrics = cluster.preference_step(batch.union(reference), self.config.loss, point.item())[0]
        desirable = sum(row.desirable for row in rows)
        if desirable in (0, len(rows)):
            logger.warning(
                "a KTO batch of %d rows holds only %s completions",
                len(rows),
                "desirable" if desirable else "undesirable",
            )
        counts = {
            "kto/desirable_rows": float(desirable),
            "kto/undesirable_rows": float(len(rows) - desirable),
            # z0 before the clamp at 0: the policy's drift on completions of other prompts.
            "kto/mismatched_log_ratio": (policy_mismatched - reference_mismatched).mean().item(),
        }
        return {f"actor/{key}": value for key, value in (kto_class_metrics(metrics) | counts).items()} | timings

    def postfix(self, metrics: dict[str, float], evaluation: dict[str, float]) -> dict[str, str]:
        """Loss, reward margin (absent when a KTO batch held one class) and the latest held-out accuracy."""
        margin = metrics.get("actor/rewards/margin", float("nan"))
        return progress_postfix(metrics["actor/loss"], evaluation["val/preference_accuracy"], margin=f"{margin:.2f}")

    def summarize(self, before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], str]:
        """Held-out preference accuracy, and the policy's own ranking accuracy, before and after."""
        summary = before_after_summary(before, after, "preference_accuracy", "policy_ranking_accuracy")
        what = ("desirable over undesirable completions", "desirable") if self.unpaired else ("preference", "chosen")
        line = (
            f"held-out {what[0]} accuracy {before['val/preference_accuracy']:.2f} -> "
            f"{after['val/preference_accuracy']:.2f} (policy ranks the {what[1]} response first: "
            f"{before['val/policy_ranking_accuracy']:.2f} -> {after['val/policy_ranking_accuracy']:.2f})"
        )
        return summary, line
