"""A process reward model's loss and metrics: per-token scores read only where a step ends.

`scores` are the model's logits at each response token `[B, R]`; `labels` hold 1 where the step ending
at that token is correct and 0 where it is wrong; `mask` marks the tokens where a step ends (the last
token of its separator). Everything else (prompt, step text, padding) carries no loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roll.utils.functionals import masked_mean


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
