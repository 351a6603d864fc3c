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


def kto_reference_point(policy_mismatched: torch.Tensor, reference_mismatched: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0: the batch's estimate of KL(pi || pi_ref), clamped at 0 and detached.

    The inputs are sequence log-probs of mismatched rows (a prompt of the batch with the completion of
    another prompt of the batch), as in the KTO paper (Ethayarajh et al. 2024, eq. 4): z0 =
    max(0, mean(log pi(y'|x) - log pi_ref(y'|x))). Rows whose completion answers their own prompt
    would measure how the policy moved on the training targets, not its drift in general.
    """
    return (policy_mismatched - reference_mismatched).mean().detach().clamp(min=0)


def kto_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's per-row losses on unpaired completions and their (detached) implicit rewards.

    With r = log pi(y|x) - log pi_ref(y|x) and the reference point z0 (`kto_reference_point`, no
    gradient): a desirable row's loss is w_d (1 - sigmoid(beta (r - z0))), an undesirable row's
    w_u (1 - sigmoid(beta (z0 - r))); the implicit reward is beta r.
    """
    log_ratio = policy - reference
    losses = torch.where(
        desirable.bool(),
        desirable_weight * (1 - torch.sigmoid(beta * (log_ratio - reference_point))),
        undesirable_weight * (1 - torch.sigmoid(beta * (reference_point - log_ratio))),
    )
    return losses, beta * log_ratio.detach()


def ranking_accuracy(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Fraction of pairs whose chosen score is higher; a tie counts half (as a coin flip would)."""
    wins = (chosen_scores > rejected_scores).float() + 0.5 * (chosen_scores == rejected_scores).float()
    return wins.mean()
