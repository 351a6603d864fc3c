"""The Bradley-Terry pairwise loss of a reward model: the chosen response should score above the rejected one."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """Per-pair losses `-log sigmoid(r_chosen - r_rejected - margin)`.

    `margin` (a constant or one value per pair, as Llama 2's reward model uses) asks the chosen score
    to lead by at least that much before the loss fades.
    """
    return -F.logsigmoid(chosen_scores - rejected_scores - margin)
