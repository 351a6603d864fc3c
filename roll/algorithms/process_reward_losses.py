"""A process reward model's loss and metrics, and its scores as RL rewards: per-token scores read only where a
step ends.

`scores` are the model's logits at each response token `[B, R]`; `labels` hold 1 where the step ending
at that token is correct and 0 where it is wrong; `mask` marks the tokens where a step ends (the last
token of its separator). Everything else (prompt, step text, padding) carries no loss.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from roll.utils.functionals import masked_mean

# How a response's step rewards become one score: its worst step, or its last.
StepAggregate = Literal["min", "last"]


def step_bce_loss(scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of sigmoid(score) against the step labels, averaged over the step-end tokens only."""
    losses = F.binary_cross_entropy_with_logits(scores, labels.to(scores.dtype), reduction="none")
    return masked_mean(losses, mask)


def step_accuracy(scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of the steps whose label the score gets right (a positive score calls the step correct)."""
    right = ((scores > 0) == labels.bool()).to(scores.dtype)
    return masked_mean(right, mask)


def first_error_found(scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Among the responses with a wrong step, the fraction whose first step scored wrong is their first wrong
    step (NaN when no response has one)."""
    steps = mask.bool()
    wrong, called_wrong = steps & ~labels.bool(), steps & (scores <= 0)
    has_error = wrong.any(-1)
    # argmax returns the first maximum: the first marked position of each row.
    found = called_wrong.any(-1) & (called_wrong.int().argmax(-1) == wrong.int().argmax(-1))
    return found[has_error].float().mean()


def step_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each step's reward on its end token: sigmoid(score), the model's probability that the step is correct,
    where `mask` is 1; 0 elsewhere. `[B, R]` -> `[B, R]`."""
    return torch.where(mask.bool(), torch.sigmoid(scores.float()), torch.zeros_like(scores, dtype=torch.float32))


def aggregate_step_rewards(rewards: torch.Tensor, mask: torch.Tensor, how: StepAggregate) -> torch.Tensor:
    """One score per response from its step rewards `[B, R]` at the step ends `mask`: the smallest (`min`) or the
    last step's (`last`); 0 for a response without a step. `[B, R]` -> `[B]`."""
    steps = mask.bool()
    if how == "min":
        worst = torch.where(steps, rewards, torch.full_like(rewards, torch.inf)).min(-1).values
        return torch.where(steps.any(-1), worst, torch.zeros_like(worst))
    # The last marked position of each row (0 when none, whose reward is then 0 as the mask is).
    positions = torch.arange(1, rewards.shape[1] + 1, device=rewards.device)
    last = (steps * positions).max(-1).values.sub(1).clamp(min=0)
    return torch.where(steps.any(-1), rewards.gather(-1, last.unsqueeze(-1)).squeeze(-1), torch.zeros(len(rewards)))
