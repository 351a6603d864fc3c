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


def step_rewards(scores: torch.Tensor, mask: torch.Tensor, how: StepAggregate) -> torch.Tensor:
    """Each step's reward on its end token (`mask`), 0 elsewhere: how much the step moves the running aggregate of
    the steps' probabilities sigmoid(score), their min (`min`) or the latest (`last`), which starts at 0.
    `[B, R]` -> `[B, R]`.

    A response's step rewards sum to its aggregate (the score an outcome estimator reads); a step that keeps the
    aggregate earns 0. Summed raw probabilities would pay for every extra step, and a policy learns to add steps.
    """
    probabilities = torch.sigmoid(scores.float())
    rewards = torch.zeros_like(probabilities)
    running = torch.zeros(len(scores), dtype=probabilities.dtype, device=scores.device)
    seen = torch.zeros(len(scores), dtype=torch.bool, device=scores.device)
    for t in range(scores.shape[1]):
        ends = mask[:, t].bool()
        value = probabilities[:, t]
        if how == "min":
            value = torch.where(seen, torch.minimum(running, value), value)
        rewards[:, t] = torch.where(ends, value - running, rewards[:, t])
        running, seen = torch.where(ends, value, running), seen | ends
    return rewards
