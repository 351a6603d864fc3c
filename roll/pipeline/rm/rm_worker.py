"""The reward model in training: scores rows like RLVR's reward-model cluster and takes Bradley-Terry steps on pairs."""

from __future__ import annotations

from typing import Any

import torch

from roll.algorithms.preference_losses import ranking_accuracy
from roll.algorithms.reward_model_losses import bradley_terry_loss
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.reward_model_worker import RewardModelWorker, sequence_scores


def pairwise_objective(scores: torch.Tensor, margin: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean Bradley-Terry loss of rows laid out as pairs (chosen at even rows, rejected at odd ones), and its
    metrics: pairwise accuracy and the mean scores of the chosen and the rejected responses and their gap."""
    chosen, rejected = scores[0::2], scores[1::2]
    losses = bradley_terry_loss(chosen, rejected, margin)
    chosen, rejected = chosen.detach(), rejected.detach()
    metrics = {
        "accuracy": ranking_accuracy(chosen, rejected),
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margin": (chosen - rejected).mean(),
    }
    return losses.mean(), metrics


class RewardTrainWorker(RewardModelWorker):
    """The `reward_model` role of the RM pipeline: `compute_scores` for evaluation and `reward_pair_step`."""

    @register(Dispatch.DP_COMPUTE)
    def reward_pair_step(self, batch: DataProto, margin: float) -> dict[str, float]:
        """Bradley-Terry update on this rank's shard of pairs; a micro-batch holds whole pairs, so one forward pass
        scores both responses of each of them."""

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return pairwise_objective(sequence_scores(output), margin)

        return self.strategy.train_step(batch, loss_func)
