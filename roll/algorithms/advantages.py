"""Advantage estimators over response tokens, registered by name with one uniform signature.

Every estimator maps `token_rewards[B, T]` and `response_mask[B, T]` (plus the keywords of
`AdvantageEstimator`) to `(advantages[B, T], returns[B, T])`, both zero outside the mask. Token
rewards are zero outside the mask except for an empty response, whose score sits at a masked-out
position (`roll.pipeline.rlvr.rollout.outcome_token_rewards`): outcome estimators (grpo, rloo) count
it in their group statistics, token-level ones (gae, reinforce_plus_plus) ignore masked positions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Protocol

import torch

from roll.algorithms.reward_shaping import normalize_scores
from roll.utils.functionals import group_stats, masked_mean


class AdvantageEstimator(Protocol):
    """The uniform estimator signature; estimators ignore the keywords they do not use."""

    def __call__(
        self,
        token_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_index: torch.Tensor | None = None,
        gamma: float | torch.Tensor = 1.0,
        lam: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _discounted_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float,
) -> torch.Tensor:
    """GAE walking backwards over masked-in tokens only, so a masked hole (e.g. an env turn) is skipped.

    `gamma` is one discount, or one per token [B, T]: the discount from that token to the next masked-in one
    (multi-turn episodes discount between turns this way).
    """
    mask = response_mask.bool()
    gammas = torch.as_tensor(gamma, dtype=token_rewards.dtype).expand_as(token_rewards)
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gammas[:, t] * next_value - values[:, t]
        advantage = delta + gammas[:, t] * lam * next_advantage
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
        advantages[:, t] = torch.where(mask[:, t], advantage, 0.0)
    return advantages


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`(x - mean) / sqrt(var + eps)` over the masked-in entries (unbiased variance), 0 outside the mask.

    The epsilon sits inside the square root, as in verl: nearly equal values (var ~ rounding noise)
    stay near 0 instead of being blown up to +-1 as dividing by `std + eps` would do.
    """
    mask = mask.to(values.dtype)
    centered = (values - masked_mean(values, mask)) * mask
    var = (centered**2).sum() / (mask.sum() - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)


def _sequence_scores(token_rewards: torch.Tensor) -> torch.Tensor:
    """Outcome score of each sequence: the sum of its token rewards, masked out or not.

    Rewards outside the mask are zero except an empty response's score, which must count in its group.
    """
    return token_rewards.sum(-1)


def _require_groups(group_index: torch.Tensor | None, name: str) -> torch.Tensor:
    if group_index is None:
        raise ValueError(f"advantage estimator {name!r} needs a group_index")
    return group_index


_Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _uniform_signature(estimator: _Estimator) -> _Estimator:
    """`estimator` callable as an `AdvantageEstimator`: the uniform keywords it does not declare are dropped.

    Its own keywords (e.g. GRPO's `norm_by_std`) pass through; an unknown keyword still raises TypeError.
    """
    declared = inspect.signature(estimator).parameters
    unused = [name for name in ("values", "group_index", "gamma", "lam") if name not in declared]

    @functools.wraps(estimator)
    def uniform(
        token_rewards: torch.Tensor, response_mask: torch.Tensor, **keywords: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for name in unused:
            keywords.pop(name, None)
        return estimator(token_rewards, response_mask, **keywords)

    return uniform


@_uniform_signature
def gae_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float | torch.Tensor = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: `A_t = δ_t + γλ A_{t+1}`, `δ_t = r_t + γ V_{t+1} - V_t` over masked-in tokens (V after the last = 0).

    `gamma` may be a tensor [B, T] of per-token discounts (see `_discounted_gae`).

    Returns `A + V` as the value targets. `whiten=True` then whitens the advantages over all masked-in
    tokens of the batch (`masked_whiten`: mean 0, unit variance); the value targets stay unwhitened.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values")
    advantages = _discounted_gae(token_rewards, values, response_mask, gamma, lam)
    returns = (advantages + values) * response_mask.to(values.dtype)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@_uniform_signature
def grpo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: `A_i = (s_i - mean_g) / (std_g + eps)` (unbiased std), `s_i = Σ_t r_it`, broadcast over tokens.

    `norm_by_std=False` gives Dr.GRPO's `s_i - mean_g`. A group of one gets 0. Returns equal advantages.
    """
    scores = _sequence_scores(token_rewards)
    normalized = normalize_scores(scores, _require_groups(group_index, "grpo"), "group", eps, norm_by_std=norm_by_std)
    advantages = normalized.unsqueeze(-1) * response_mask.to(token_rewards.dtype)
    return advantages, advantages.clone()


@_uniform_signature
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: returns `G_t = r_t + γ G_{t+1}`; advantages `(G - mean) / sqrt(var + 1e-8)` over all masked tokens.

    `gamma` may be a tensor [B, T] of per-token discounts (see `_discounted_gae`).

    Mean and unbiased variance are taken over every masked-in token of the batch (`masked_whiten`).
    """
    mask = response_mask.to(token_rewards.dtype)
    # Return-to-go is GAE with a zero critic and λ = 1.
    returns = _discounted_gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)
    return masked_whiten(returns, mask), returns


@_uniform_signature
def rloo_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, *, group_index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: `A_i = s_i - mean_{j≠i in g} s_j = n/(n-1) (s_i - mean_g)`, broadcast over tokens; a group of one gets 0.

    Returns equal advantages.
    """
    scores = _sequence_scores(token_rewards)
    mean, _, count = group_stats(scores, _require_groups(group_index, "rloo"))
    leave_one_out = (scores - mean) * count / (count - 1).clamp(min=1)
    advantages = leave_one_out.unsqueeze(-1) * response_mask.to(token_rewards.dtype)
    return advantages, advantages.clone()


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "rloo": rloo_advantages,
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under `name`; ValueError listing the valid names otherwise."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}") from None
