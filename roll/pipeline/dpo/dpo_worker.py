"""The DPO policy worker: the actor's forward passes plus a preference update on chosen/rejected pairs."""

from __future__ import annotations

from typing import Any

import torch

from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base_worker import ActorWorker
from roll.pipeline.dpo.dpo_config import PreferenceLossArguments
from roll.utils import dpo_losses
from roll.utils.functionals import response_log_probs


def preference_objective(
    policy: torch.Tensor, reference: torch.Tensor, loss: PreferenceLossArguments
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean preference loss of rows laid out as pairs (chosen at even rows, rejected at odd ones) and its metrics.

    `policy` and `reference` are sequence log-probs `[2P]`. KTO reads the same rows unpaired: chosen
    desirable, rejected undesirable.
    """
    chosen, rejected = slice(0, None, 2), slice(1, None, 2)
    if loss.loss_type == "kto":
        desirable = torch.zeros_like(policy, dtype=torch.bool)
        desirable[chosen] = True
        losses, rewards, reference_point = dpo_losses.kto_loss(
            policy, reference, desirable, loss.beta, loss.kto_desirable_weight, loss.kto_undesirable_weight
        )
        chosen_rewards, rejected_rewards = rewards[chosen], rewards[rejected]
        extra = {"kto/reference_point": reference_point}
    else:
        losses, chosen_rewards, rejected_rewards = dpo_losses.dpo_loss(
            policy[chosen],
            policy[rejected],
            reference[chosen],
            reference[rejected],
            loss.beta,
            loss.loss_type,
            loss.label_smoothing,
        )
        extra = {}
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": policy[chosen].detach().mean(),
        "logps/rejected": policy[rejected].detach().mean(),
        **extra,
    }
    return losses.mean(), metrics


class DPOWorker(ActorWorker):
    """actor_train of the DPO pipeline: scores like the actor (`compute_log_probs`) and trains on preference pairs."""

    @register(Dispatch.DP_COMPUTE)
    def preference_step(self, batch: DataProto, loss: PreferenceLossArguments) -> dict[str, float]:
        """Preference update on this rank's shard of pairs, given the reference's per-token `ref_log_probs`.

        A micro-batch holds whole pairs, so one forward pass scores both responses of each of them.
        """
        average = loss.loss_type in dpo_losses.LENGTH_AVERAGED

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            mask = data["response_mask"]
            token_log_probs = response_log_probs(output.logits, data["input_ids"], data["responses"].shape[1])
            policy = dpo_losses.sequence_log_probs(token_log_probs, mask, average)
            reference = dpo_losses.sequence_log_probs(data["ref_log_probs"].to(policy.device), mask, average)
            return preference_objective(policy, reference, loss)

        return self.strategy.train_step(batch, loss_func)
