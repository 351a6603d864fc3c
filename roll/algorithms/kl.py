"""Per-token KL estimators against the reference policy, KL coefficient controllers and the reward penalty."""

from __future__ import annotations

from typing import Literal

import torch

from roll.utils.functionals import masked_mean

KLKind = Literal["k1", "k2", "k3", "abs"]

# The bounds verl and OpenRLHF use for k3. A log-ratio beyond +-20 (a ratio beyond ~5e8) only comes from
# garbage log-probs (e.g. a padded position); exp(20) is still finite in fp32, so nothing overflows.
MAX_LOG_RATIO = 20.0
MAX_K3 = 10.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π, with `d = log_probs - ref_log_probs`.

    k1 = d; k2 = d² / 2; k3 = exp(-d) + d - 1 (unbiased, low variance, >= 0); abs = |d|.
    `d` is clamped to [-20, 20] and k3 to [-10, 10] (as verl and OpenRLHF do), so every estimate is
    finite even for -inf log-probs; clamped tokens get no gradient.
    """
    log_ratio = (log_probs - ref_log_probs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return (torch.exp(-log_ratio) + log_ratio - 1).clamp(-MAX_K3, MAX_K3)
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; valid: 'k1', 'k2', 'k3', 'abs'")


def masked_kl_estimate(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, kind: KLKind
) -> torch.Tensor:
    """`kl_estimate` inside `mask` and exactly 0 outside it, whatever the log-probs there."""
    kl = kl_estimate(log_probs, ref_log_probs, kind)
    return torch.where(mask.bool(), kl, torch.zeros_like(kl))


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
    """`r - coef * kl` per token, and the masked mean KL of each sequence (`[B]`).

    The KL is 0 outside the mask, so rewards there pass unchanged (an empty response's score; see
    `roll.pipeline.rlvr.rollout.outcome_token_rewards`).
    """
    kl = masked_kl_estimate(log_probs, ref_log_probs, response_mask, kind)
    return token_rewards - coef * kl, masked_mean(kl, response_mask, dim=-1)
