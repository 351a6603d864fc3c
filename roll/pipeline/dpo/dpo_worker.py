"""The DPO policy worker: the actor's forward passes plus a preference update on pairs (DPO, IPO) or labelled
completions (KTO)."""

from __future__ import annotations

from typing import Any

import torch

from roll.algorithms import preference_losses
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.rl_workers import ActorWorker
from roll.pipeline.dpo.dpo_config import PreferenceLossArguments
from roll.utils.functionals import response_log_probs

# KTO's per-micro-batch sums over rows, which `kto_class_metrics` turns into per-class means.
_DESIRABLE_FRACTION = "kto/desirable_fraction"
_REWARD_PER_ROW = {"desirable": "kto/desirable_reward_per_row", "undesirable": "kto/undesirable_reward_per_row"}


def pair_objective(
    policy: torch.Tensor, reference: torch.Tensor, loss: PreferenceLossArguments
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean DPO/IPO loss of rows laid out as pairs (chosen at even rows, rejected at odd ones) and its metrics.

    `policy` and `reference` are sequence log-probs `[2P]`.
    """
    chosen, rejected = slice(0, None, 2), slice(1, None, 2)
    losses, chosen_rewards, rejected_rewards = preference_losses.dpo_loss(
        policy[chosen],
        policy[rejected],
        reference[chosen],
        reference[rejected],
        loss.beta,
        loss.loss_type,
        loss.label_smoothing,
    )
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": policy[chosen].detach().mean(),
        "logps/rejected": policy[rejected].detach().mean(),
    }
    return losses.mean(), metrics


def kto_objective(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: float,
    loss: PreferenceLossArguments,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean KTO loss of unpaired rows against the step's reference point, and its metrics.

    A micro-batch may hold one class only, so the per-class rewards are reported as sums over the
    micro-batch's rows (divided by its row count); `kto_class_metrics` turns their averages into means.
    """
    losses, rewards = preference_losses.kto_loss(
        policy,
        reference,
        desirable,
        reference_point,
        loss.beta,
        loss.kto_desirable_weight,
        loss.kto_undesirable_weight,
    )
    weight = desirable.to(rewards.dtype)
    metrics = {
        _DESIRABLE_FRACTION: weight.mean(),
        _REWARD_PER_ROW["desirable"]: (rewards * weight).mean(),
        _REWARD_PER_ROW["undesirable"]: (rewards * (1 - weight)).mean(),
        "kto/reference_point": torch.tensor(reference_point),
    }
    return losses.mean(), metrics


def kto_class_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` of KTO steps with the per-row sums replaced by each class's mean implicit reward (and their
    margin); a class the step had no row of gets no mean."""
    result = {k: v for k, v in metrics.items() if k not in _REWARD_PER_ROW.values()}
    fractions = {"desirable": metrics[_DESIRABLE_FRACTION], "undesirable": 1 - metrics[_DESIRABLE_FRACTION]}
    for name, fraction in fractions.items():
        if fraction > 0:
            result[f"rewards/{name}"] = metrics[_REWARD_PER_ROW[name]] / fraction
    if len(result.keys() & {"rewards/desirable", "rewards/undesirable"}) == 2:
        result["rewards/margin"] = result["rewards/desirable"] - result["rewards/undesirable"]
    return result


class DPOWorker(ActorWorker):
    """actor_train of the DPO pipeline: scores like the actor (`compute_log_probs`) and takes preference steps."""

    @register(Dispatch.DP_COMPUTE)
    def preference_step(
        self, batch: DataProto, loss: PreferenceLossArguments, reference_point: float = 0.0
    ) -> dict[str, float]:
        """Preference update on this rank's shard, given the reference's per-token `ref_log_probs`.

        Pairs: a micro-batch holds whole pairs, so one forward pass scores both responses of each.
        KTO: rows carry `desirable`; `reference_point` is the step's z0 (`preference_losses.kto_reference_point`).
        """
        average = loss.loss_type in preference_losses.LENGTH_AVERAGED

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            mask = data["response_mask"]
            token_log_probs = response_log_probs(output.logits, data["input_ids"], data["responses"].shape[1])
            policy = preference_losses.sequence_log_probs(token_log_probs, mask, average)
            reference = preference_losses.sequence_log_probs(data["ref_log_probs"].to(policy.device), mask, average)
            if loss.loss_type == "kto":
                return kto_objective(policy, reference, data["desirable"].to(policy.device), reference_point, loss)
            return pair_objective(policy, reference, loss)

        return self.strategy.train_step(batch, loss_func)
