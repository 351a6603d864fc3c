"""The process reward model in training: a score at every token, trained by binary cross-entropy where steps end.

The model is the value-model kind (AutoModelForTokenClassification with one label, the critic's
head on the backbone): it scores every token, where a sequence-classification model keeps only the
last token's score. It can start from a `roll-rm` export: the backbone and the `score` weights load,
the token head's bias starts at 0.
"""

from __future__ import annotations

from typing import Any

import torch

from roll.algorithms.process_reward_losses import step_accuracy, step_bce_loss
from roll.distributed.executor.strategy_worker import StrategyWorker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.micro_batches import step_normalised
from roll.models.model_providers import ModelKind
from roll.pipeline.base.reward_model_worker import response_scores
from roll.utils.functionals import masked_mean


def process_objective(
    scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The BCE loss at the step-end tokens `mask` and its metrics: step accuracy, the mean step-end score."""
    metrics = {
        "step_accuracy": step_accuracy(scores.detach(), labels, mask),
        "step_score": masked_mean(scores.detach(), mask),
    }
    return step_bce_loss(scores, labels, mask), metrics


class ProcessRewardTrainWorker(StrategyWorker):
    """Trains a process reward model: the `reward_model` role of `roll-rm` on step-labelled data
    (`compute_step_scores` and `process_reward_step`). RLVR scores with the exported model through
    `roll.pipeline.base.reward_model_worker.ProcessRewardScoringWorker`."""

    model_kind: ModelKind = "value"

    @register(Dispatch.DP_COMPUTE)
    def compute_step_scores(self, batch: DataProto) -> DataProto:
        """The score at every response token: `step_scores` `[B, R]` (meaningful where `step_mask` is 1)."""

        def forward(micro_batch: DataProto, output: Any) -> tuple[None, dict[str, torch.Tensor]]:
            return None, {"step_scores": response_scores(output, micro_batch.batch["responses"].shape[1])}

        return DataProto.from_dict(tensors=self.strategy.forward_step(batch, forward))

    @register(Dispatch.DP_COMPUTE)
    def process_reward_step(self, batch: DataProto) -> dict[str, float]:
        """BCE update on this rank's shard of step-labelled responses (`step_labels` at `step_mask`): the mean over
        every step end of each optimizer step, on every data-parallel rank."""

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            scores = response_scores(output, data["responses"].shape[1])
            mask = data["step_mask"].to(scores.device)
            loss, metrics = process_objective(scores, data["step_labels"].to(scores.device), mask)
            return step_normalised(loss, micro_batch, "token-mean", "step_mask"), metrics

        return self.strategy.train_step(batch, loss_func)
