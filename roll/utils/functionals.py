"""Pure tensor functions shared by losses, metrics and workers."""

from __future__ import annotations

import torch


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under `logits` (`[..., vocab]` -> `[...]`), computed in fp32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1; 0 where nothing is masked in."""
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def group_stats(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, unbiased std and size of each row's group (`[B]` -> three `[B]`); a group of one has std 0."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    inverse = inverse.to(values.device)
    counts = counts.to(device=values.device, dtype=values.dtype)
    zeros = torch.zeros(len(counts), dtype=values.dtype, device=values.device)
    means = zeros.index_add(0, inverse, values) / counts
    squares = zeros.index_add(0, inverse, (values - means[inverse]) ** 2)
    stds = (squares / (counts - 1).clamp(min=1)).sqrt()
    return means[inverse], stds[inverse], counts[inverse]


def response_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, response_length: int) -> torch.Tensor:
    """Log-probs of the last `response_length` tokens of `input_ids` (prompt then response): `[B, R]`."""
    return log_probs_from_logits(logits[:, -response_length - 1 : -1], input_ids[:, -response_length:])


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """1 on the first `lengths[i]` positions of row i, 0 after them: `[B]` -> `[B, width]` (long)."""
    return (torch.arange(width, device=lengths.device) < lengths[:, None]).long()
