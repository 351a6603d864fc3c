"""Per-token KL estimators against the reference policy, KL coefficient controllers and the reward penalty."""

from __future__ import annotations

from typing import Literal

import torch

from roll.utils.functionals import masked_mean

KLKind = Literal["k1", "k2", "k3", "abs"]


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π, with `d = log_probs - ref_log_probs`.

    k1 = d; k2 = d² / 2; k3 = exp(-d) + d - 1 (unbiased, low variance, >= 0); abs = |d|.
    """
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; valid: 'k1', 'k2', 'k3', 'abs'")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays `coef`."""


class AdaptiveKLController:
    """Ziegler et al. (2019): steer the KL coefficient so the observed KL tracks `target`."""

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """`value *= 1 + e * n_steps / horizon` with `e = clip(current_kl / target - 1, -0.2, 0.2)`."""
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kind: KLKind = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(r - coef * kl) * mask` per token, and the masked mean KL of each sequence (`[B]`)."""
    kl = kl_estimate(log_probs, ref_log_probs, kind)
    mask = response_mask.to(token_rewards.dtype)
    return (token_rewards - coef * kl) * mask, masked_mean(kl, mask, dim=-1)
