"""Knowledge-distillation losses over the teacher's top-k tokens: forward KL, reverse KL and their mix.

At each response position the teacher gives its `k` most likely tokens `S` and their log-probs
`log p(i)` under its full-vocabulary softmax; the student's log-probs `log q(i)` (its own
full-vocabulary softmax) are read at the same tokens. Both become distributions on the same support
(`support_log_probs`):

- `renormalized`: `S` alone, each side divided by its own mass on it:
  `p~(i) = p(i) / sum_{j in S} p(j)`, `q~(i) = q(i) / sum_{j in S} q(j)`. It ignores where the
  student puts mass outside `S`.
- `tail`: `S` plus one bucket for every other token, holding `1 - sum_{j in S} p(j)` (resp. `q`), so
  nothing is renormalised and mass the student puts outside `S` is penalised. With `k` = the
  vocabulary size the tail is empty and the loss is the exact full-vocabulary KL.

Then forward KL is `KL(p~ || q~) = sum_i p~(i) (log p~(i) - log q~(i))` (mass-covering), reverse KL
is `KL(q~ || p~)` (mode-seeking), and `mixed` is `w * forward + (1 - w) * reverse`.
"""

from __future__ import annotations

from typing import Literal

import torch

from roll.algorithms.policy_losses import AggMode, aggregate_loss

DivergenceKind = Literal["forward", "reverse", "mixed"]
Support = Literal["renormalized", "tail"]

# The smallest mass a tail bucket holds: a teacher whose top-k covers (numerically) all its mass would otherwise
# give log 0 = -inf, and a student tail of exactly 0 nan gradients.
TAIL_FLOOR = 1e-6


def teacher_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely tokens of each position of `logits` `[..., V]` and their full-softmax log-probs, in fp32:
    (indices `[..., k]`, log-probs `[..., k]`), most likely first."""
    values, indices = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return indices, values


def support_log_probs(log_probs: torch.Tensor, support: Support) -> torch.Tensor:
    """A distribution on the top-k support from full-softmax `log_probs` `[..., k]` at its tokens (module docstring):
    `[..., k]` renormalized, or `[..., k + 1]` with the tail bucket last."""
    covered = torch.logsumexp(log_probs, dim=-1, keepdim=True)
    if support == "renormalized":
        return log_probs - covered
    if support == "tail":
        tail = (-torch.expm1(covered)).clamp(min=TAIL_FLOOR).log()
        return torch.cat([log_probs, tail], dim=-1)
    raise ValueError(f"unknown top-k support {support!r}; valid: 'renormalized', 'tail'")


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """`KL(p || q) = sum_i p(i) (log p(i) - log q(i))` over the last dimension of two log-distributions."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def token_divergence(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    kind: DivergenceKind,
    forward_weight: float = 0.5,
    support: Support = "tail",
) -> torch.Tensor:
    """Per-position divergence `[B, R]` of the student from the teacher on the teacher's top-k tokens.

    Both inputs are full-softmax log-probs at the teacher's top-k tokens, `[B, R, k]`. `mixed` is
    `forward_weight * KL(p || q) + (1 - forward_weight) * KL(q || p)`.
    """
    log_p = support_log_probs(teacher_log_probs.to(student_log_probs.dtype), support)
    log_q = support_log_probs(student_log_probs, support)
    if kind == "forward":
        return kl_divergence(log_p, log_q)
    if kind == "reverse":
        return kl_divergence(log_q, log_p)
    if kind == "mixed":
        return forward_weight * kl_divergence(log_p, log_q) + (1 - forward_weight) * kl_divergence(log_q, log_p)
    raise ValueError(f"unknown divergence {kind!r}; valid: 'forward', 'reverse', 'mixed'")


def distillation_loss(
    student_logits: torch.Tensor,
    labels: torch.Tensor,
    teacher_indices: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kind: DivergenceKind,
    forward_weight: float = 0.5,
    support: Support = "tail",
    nll_weight: float = 0.0,
    agg_mode: AggMode = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The student's loss at the response positions and its metrics.

    `student_logits` `[B, R, V]` predict `labels` `[B, R]` (the demonstrated response); the teacher's
    top-k at the same positions are `teacher_indices` / `teacher_log_probs` `[B, R, k]`. The loss is the
    divergence (`token_divergence`) aggregated over `mask` by `agg_mode` (see `aggregate_loss`), plus
    `nll_weight` times the labels' negative log-likelihood aggregated the same way.
    Metrics: `kl` (the divergence term), `nll`, and `teacher_top1_agreement`, the fraction of masked-in
    positions where the student's most likely token is the teacher's.
    """
    student_log_probs = torch.log_softmax(student_logits.float(), dim=-1)
    at_support = student_log_probs.gather(-1, teacher_indices)
    divergence = token_divergence(at_support, teacher_log_probs, kind, forward_weight, support)
    kl = aggregate_loss(divergence, mask, agg_mode, norm_length)
    label_log_probs = student_log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    nll = aggregate_loss(-label_log_probs, mask, agg_mode, norm_length)
    loss = kl + nll_weight * nll if nll_weight else kl
    agrees = (student_logits.argmax(-1) == teacher_indices[..., 0]).float()
    agreement = aggregate_loss(agrees, mask, "token-mean")
    return loss, {"kl": kl.detach(), "nll": nll.detach(), "teacher_top1_agreement": agreement}
