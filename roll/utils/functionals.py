"""Pure tensor functions shared by losses, metrics and workers."""

from __future__ import annotations

import torch


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under `logits` (`[..., vocab]` -> `[...]`), computed in fp32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def next_token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of token t+1 given tokens up to t: `[B, T]` ids -> `[B, T-1]`."""
    return log_probs_from_logits(logits[:, :-1], input_ids[:, 1:])


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1; 0 where nothing is masked in."""
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)
