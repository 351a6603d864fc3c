"""Sequence-level score processing between the reward workers and the advantage estimator."""

from __future__ import annotations

from typing import Literal

import torch

from roll.utils.functionals import group_stats

NormMode = Literal["none", "group", "batch"]


def normalize_scores(
    scores: torch.Tensor,
    group_index: torch.Tensor | None = None,
    mode: NormMode = "none",
    eps: float = 1e-6,
    *,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Centre `scores[B]` on their group ("group") or batch ("batch") mean and divide by `std + eps`.

    Std is unbiased; a group of one maps to 0. `norm_by_std=False` only centres (Dr.GRPO). "none" returns a copy.
    """
    if mode == "none":
        return scores.clone()
    if mode == "batch":
        group_index = torch.zeros(scores.shape, dtype=torch.long, device=scores.device)
    elif mode != "group":
        raise ValueError(f"unknown score normalization mode {mode!r}; valid: 'none', 'group', 'batch'")
    elif group_index is None:
        raise ValueError("mode='group' needs a group_index")
    mean, std, _ = group_stats(scores, group_index)
    centered = scores - mean
    return centered / (std + eps) if norm_by_std else centered


def clip_scores(scores: torch.Tensor, low: float | None = None, high: float | None = None) -> torch.Tensor:
    """`scores` clamped to `[low, high]`; a `None` bound is open."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"clip_scores: low={low} > high={high}")
    return scores.clamp(min=low, max=high)


def dynamic_sampling_keep(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Bool `[B]`: True for rows whose group has max score != min score (DAPO); constant groups carry no signal."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    inverse = inverse.to(scores.device)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    empty = torch.empty(num_groups, dtype=scores.dtype, device=scores.device)
    highs = empty.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    lows = empty.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    return (highs != lows)[inverse]


def group_index_from_repeat(num_prompts: int, n: int, interleave: bool = True) -> torch.Tensor:
    """Group (prompt) index of the `num_prompts * n` rows made by repeating each prompt `n` times.

    `interleave=True`: a,a,b,b -> [0, 0, 1, 1]; `False`: a,b,a,b -> [0, 1, 0, 1].
    """
    prompts = torch.arange(num_prompts)
    return prompts.repeat_interleave(n) if interleave else prompts.repeat(n)


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong penalty `[B]`: 0 up to `max_length - buffer_len` tokens, then linear down to `-factor`.

    `-factor * clamp((L - (max_length - buffer_len)) / buffer_len, 0, 1)` for a response of L tokens.
    """
    if not 0 < buffer_len <= max_length:
        raise ValueError(f"overlong buffer_len={buffer_len} must be in (0, max_length={max_length}]")
    exceed = (response_lengths.float() - (max_length - buffer_len)) / buffer_len
    return -factor * exceed.clamp(0.0, 1.0)
