"""The roles of offline distillation: the teacher gives its top-k log-probs, the student trains on them."""

from __future__ import annotations

from typing import Any

import torch

from roll.algorithms.distillation_losses import distillation_loss
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.micro_batches import step_normalised
from roll.distributed.strategy.response_scores import response_logits
from roll.pipeline.base.rl_workers import MAX_RESPONSE_LENGTH, ActorWorker
from roll.pipeline.distill.distill_config import DistillLossArguments


class TeacherWorker(ActorWorker):
    """The frozen teacher: its top-k log-probs at every response position, and generation (held-out accuracy)."""

    @register(Dispatch.DP_COMPUTE)
    def compute_top_k_log_probs(self, batch: DataProto, k: int, vocab_size: int | None = None) -> DataProto:
        """`teacher_top_indices` and `teacher_top_log_probs` `[B, R, k]`: the teacher's `k` most likely tokens at
        each response position and their log-probs, most likely first.

        With `vocab_size` the softmax is over the first `vocab_size` ids only (the ids the student also has). Forward
        passes or an engine's prompt log-probs: see `InferenceStrategy.response_top_k`.
        """
        indices, log_probs = self.strategy.response_top_k(batch, k, vocab_size)
        return DataProto.from_dict(tensors={"teacher_top_indices": indices, "teacher_top_log_probs": log_probs})


class StudentWorker(ActorWorker):
    """The student: generates like the actor (held-out accuracy) and trains on the teacher's top-k log-probs."""

    @register(Dispatch.DP_COMPUTE)
    def distill_step(self, batch: DataProto, loss: DistillLossArguments) -> dict[str, float]:
        """Distillation update on this rank's shard of demonstrations with the teacher's top-k (see
        `roll.algorithms.distillation_losses.distillation_loss`); metrics `loss`, `kl`, `nll`,
        `teacher_top1_agreement`."""

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            responses = data["responses"]
            logits = response_logits(output.logits, responses.shape[1])
            value, metrics = distillation_loss(
                logits,
                responses.to(logits.device),
                data["teacher_top_indices"].to(logits.device),
                data["teacher_top_log_probs"].to(logits.device),
                data["response_mask"].to(logits.device),
                loss.kind,
                loss.forward_weight,
                loss.support,
                loss.nll_weight,
                loss.agg_mode,
                micro_batch.meta_info.get(MAX_RESPONSE_LENGTH),
            )
            return step_normalised(value, micro_batch, loss.agg_mode), metrics

        return self.strategy.train_step(batch, loss_func)
