"""Preference losses on sequence log-probs: DPO's sigmoid loss (with conservative label smoothing), IPO and KTO.

Every loss compares the policy with a frozen reference through the implicit reward
`beta * (log pi(y|x) - log pi_ref(y|x))` of each response.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

PreferenceLossType = Literal["sigmoid", "ipo", "kto"]
# IPO regresses the log-ratio margin of per-token mean log-probs (the IPO paper's and TRL's choice); the
# others use the sequence's summed log-prob.
LENGTH_AVERAGED: frozenset[str] = frozenset({"ipo"})


def sequence_log_probs(token_log_probs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Each row's summed (or, with `average`, per-token mean) log-prob over the tokens `mask` keeps: `[B]`."""
    mask = mask.to(token_log_probs.dtype)
    total = (token_log_probs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the (detached) implicit rewards of the chosen and the rejected responses.

    With h = (log pi(c) - log pi(r)) - (log pi_ref(c) - log pi_ref(r)):
    sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h), eps = `label_smoothing` (cDPO:
    the preference label is taken to be flipped with probability eps); ipo: (h - 1 / (2 beta))^2.
    """
    margin = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; use sigmoid or ipo")
    chosen_rewards = beta * (policy_chosen - reference_chosen).detach()
    rejected_rewards = beta * (policy_rejected - reference_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def kto_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO's per-row losses on unpaired responses, their (detached) implicit rewards and the reference point.

    With r = log pi(y) - log pi_ref(y) and the reference point z = max(0, mean of r over the batch), detached:
    a desirable row's loss is w_d (1 - sigmoid(beta (r - z))), an undesirable row's w_u (1 - sigmoid(beta (z - r))).
    KTO estimates z as the KL between policy and reference; the batch's mean log-ratio is that estimate
    from the rows at hand (no extra forward pass over mismatched prompt-response pairs, as TRL makes).
    """
    log_ratio = policy - reference
    reference_point = log_ratio.mean().detach().clamp(min=0)
    losses = torch.where(
        desirable.bool(),
        desirable_weight * (1 - torch.sigmoid(beta * (log_ratio - reference_point))),
        undesirable_weight * (1 - torch.sigmoid(beta * (reference_point - log_ratio))),
    )
    return losses, beta * log_ratio.detach(), reference_point


def ranking_accuracy(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Fraction of pairs whose chosen score is higher; a tie counts half (as a coin flip would)."""
    wins = (chosen_scores > rejected_scores).float() + 0.5 * (chosen_scores == rejected_scores).float()
    return wins.mean()
