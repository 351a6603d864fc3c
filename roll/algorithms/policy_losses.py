"""Actor and critic loss terms over response tokens, and the token/sequence aggregation they share."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from roll.algorithms.kl import KLKind, kl_estimate, masked_kl_estimate
from roll.utils.functionals import masked_mean

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[AggMode, ...] = get_args(AggMode)
ImportanceLevel = Literal["token", "sequence"]

# exp(20) ~ 5e8: large enough never to bind on real tokens, small enough that a garbage log-prob under the
# mask cannot overflow to inf (inf * 0 is nan in masked reductions).
_MAX_LOG_RATIO = 20.0


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: AggMode = "token-mean", norm_length: int | None = None
) -> torch.Tensor:
    """Reduce `loss_mat[B, T]` to a scalar over masked-in tokens.

    token-mean: Σ l·m / Σ m; seq-mean-token-mean: mean over sequences of their token mean;
    seq-mean-token-sum: mean over sequences of their token sum; seq-mean-token-sum-norm (Dr. GRPO): mean over
    sequences of their token sum divided by the constant `norm_length` (the maximum response length; `T` when
    None), so no sequence is normalised by its own length. Sequence means skip fully masked rows.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-mean":
        per_sequence = masked_mean(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-sum":
        per_sequence = (loss_mat * mask).sum(-1)
    elif mode == "seq-mean-token-sum-norm":
        per_sequence = (loss_mat * mask).sum(-1) / (loss_mat.shape[-1] if norm_length is None else norm_length)
    else:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; valid: 'token-mean', 'seq-mean-token-mean', "
            "'seq-mean-token-sum', 'seq-mean-token-sum-norm'"
        )
    return masked_mean(per_sequence, mask.amax(-1))


def aggregation_count(mask: torch.Tensor, mode: AggMode) -> float:
    """What `aggregate_loss` divides by over `mask`: its masked-in tokens (token-mean), else its sequences with any.

    A loss aggregated over part of a batch, times this part's count over the whole batch's, is its share of
    the loss aggregated over the whole batch (`roll.distributed.strategy.micro_batches.step_normalised`).
    """
    return float(mask.sum() if mode == "token-mean" else mask.amax(-1).sum())


def tis_weights(
    old_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights `min(exp(old_logp - engine_logp), cap)`, detached, 0 outside the mask.

    They correct for the trainer scoring tokens differently from the engine that sampled them (e.g. bf16
    vLLM vs fp32 trainer): the samples come from the engine's distribution, the loss assumes the trainer's.
    """
    log_ratio = (old_log_probs - engine_log_probs).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio).clamp(max=cap) * response_mask.to(old_log_probs.dtype)


def tis_metrics(
    old_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> dict[str, torch.Tensor]:
    """`tis_weights` over the masked-in tokens: their mean, their maximum and the fraction the cap clipped."""
    mask = response_mask.bool()
    log_ratio = (old_log_probs - engine_log_probs).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)[mask]
    if not len(ratio):
        zero = torch.zeros((), dtype=old_log_probs.dtype)
        return {"tis_weight_mean": zero, "tis_weight_max": zero, "tis_clipped_fraction": zero}
    weights = ratio.clamp(max=cap)
    return {
        "tis_weight_mean": weights.mean(),
        "tis_weight_max": weights.max(),
        "tis_clipped_fraction": (ratio > cap).to(old_log_probs.dtype).mean(),
    }


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg_mode: AggMode = "token-mean",
    norm_length: int | None = None,
    importance_level: ImportanceLevel = "token",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate `max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))`, `ρ = exp(logp - old_logp)`.

    `importance_level="sequence"` (GSPO): every token of a sequence takes the sequence's ratio
    `exp(mean_t(logp - old_logp))` over its response, clipped as one. With `dual_clip = c > 1`, tokens with
    A < 0 are further bounded by `-c·A`. `token_weights` (detached, e.g. `tis_weights`) multiply the per-token
    loss before aggregation (`norm_length`: see `aggregate_loss`). Metrics (detached): clipfrac (clip term
    binds), dual_clipfrac (dual bound binds), approx_kl (k1 mean of old vs new), ratio_mean.
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = response_mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    if importance_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    elif importance_level != "token":
        raise ValueError(f"unknown importance level {importance_level!r}; valid: 'token', 'sequence'")
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss_mat > bound)
        loss_mat = torch.where(dual_active, bound, loss_mat)
    if token_weights is not None:
        loss_mat = loss_mat * token_weights
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "dual_clipfrac": masked_mean(dual_active.to(mask.dtype), mask),
            "approx_kl": masked_mean(kl_estimate(old_log_probs, log_probs, "k1"), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return aggregate_loss(loss_mat, mask, agg_mode, norm_length), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip: float | None = None,
    agg_mode: AggMode = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss `0.5·max((V - R)², (V_old + clip(V - V_old, -clip, clip) - R)²)`; `clip=None`: `0.5·(V - R)²`.

    Metrics (detached): clipfrac, the fraction of tokens where the clipped error is the larger one.
    """
    mask = response_mask.to(values.dtype)
    clipped_values = values if clip is None else old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss_mat = 0.5 * torch.maximum(unclipped_error, clipped_error)
    with torch.no_grad():
        metrics = {"clipfrac": masked_mean((clipped_error > unclipped_error).to(mask.dtype), mask)}
    return aggregate_loss(loss_mat, mask, agg_mode, norm_length), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of `softmax(logits)` per position (`[..., V]` -> `[...]`): `logsumexp(z) - Σ softmax(z)·z`, in fp32."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kind: KLKind = "k3",
    agg_mode: AggMode = "token-mean",
    norm_length: int | None = None,
) -> torch.Tensor:
    """KL-to-reference loss term: `kl_estimate` (clamped) aggregated over `mask`; masked positions contribute 0."""
    return aggregate_loss(masked_kl_estimate(log_probs, ref_log_probs, mask, kind), mask, agg_mode, norm_length)
