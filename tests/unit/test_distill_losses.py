"""Distillation losses over the teacher's top-k: hand-computed divergences, supports, masks, aggregations, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from roll.algorithms.distillation_losses import (
    TAIL_FLOOR,
    distillation_loss,
    support_log_probs,
    teacher_top_k,
    token_divergence,
)

# One position: the teacher's top-2 tokens hold 0.5 and 0.3 (0.2 left for the rest); the student gives them 0.25, 0.25.
TEACHER = torch.tensor([[[math.log(0.5), math.log(0.3)]]])
STUDENT = torch.tensor([[[math.log(0.25), math.log(0.25)]]])


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_teacher_top_k_returns_the_most_likely_tokens_and_their_full_softmax_log_probs() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    indices, values = teacher_top_k(logits, 2)
    assert indices.tolist() == [[1, 2]]
    assert values.flatten().tolist() == pytest.approx([math.log(0.6), math.log(0.3)], abs=1e-6)


def test_renormalized_support_divides_each_side_by_its_mass_on_the_top_k() -> None:
    assert support_log_probs(TEACHER, "renormalized").exp().flatten().tolist() == pytest.approx([0.625, 0.375])
    assert support_log_probs(STUDENT, "renormalized").exp().flatten().tolist() == pytest.approx([0.5, 0.5])


def test_tail_support_adds_the_rest_as_one_bucket_and_floors_an_empty_tail() -> None:
    assert support_log_probs(TEACHER, "tail").exp().flatten().tolist() == pytest.approx([0.5, 0.3, 0.2])
    full = torch.log(torch.tensor([[0.7, 0.3]]))
    assert support_log_probs(full, "tail").exp()[0, 2].item() == pytest.approx(TAIL_FLOOR)


@pytest.mark.parametrize(
    ("kind", "support", "expected"),
    [
        ("forward", "renormalized", kl([0.625, 0.375], [0.5, 0.5])),
        ("reverse", "renormalized", kl([0.5, 0.5], [0.625, 0.375])),
        ("forward", "tail", kl([0.5, 0.3, 0.2], [0.25, 0.25, 0.5])),
        ("reverse", "tail", kl([0.25, 0.25, 0.5], [0.5, 0.3, 0.2])),
    ],
)
def test_forward_and_reverse_kl_match_the_hand_computed_values(kind: str, support: str, expected: float) -> None:
    assert token_divergence(STUDENT, TEACHER, kind, support=support).item() == pytest.approx(expected, rel=1e-5)


def test_mixed_weighs_forward_and_reverse() -> None:
    forward = kl([0.5, 0.3, 0.2], [0.25, 0.25, 0.5])
    reverse = kl([0.25, 0.25, 0.5], [0.5, 0.3, 0.2])
    mixed = token_divergence(STUDENT, TEACHER, "mixed", forward_weight=0.25, support="tail")
    assert mixed.item() == pytest.approx(0.25 * forward + 0.75 * reverse, rel=1e-5)


def test_the_divergence_is_zero_when_the_student_matches_the_teacher_and_not_symmetric() -> None:
    for support in ("renormalized", "tail"):
        assert token_divergence(TEACHER, TEACHER, "forward", support=support).item() == pytest.approx(0, abs=1e-7)
    assert token_divergence(STUDENT, TEACHER, "forward").item() != pytest.approx(
        token_divergence(STUDENT, TEACHER, "reverse").item()
    )


def test_unknown_kind_and_support_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown divergence 'jsd'"):
        token_divergence(STUDENT, TEACHER, "jsd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown top-k support 'all'"):
        support_log_probs(TEACHER, "all")  # type: ignore[arg-type]


def two_rows() -> dict[str, torch.Tensor]:
    """A vocabulary of 3, two rows of 2 response positions; row 1's second position is padding."""
    student_logits = torch.log(
        torch.tensor([[[0.25, 0.25, 0.5], [0.6, 0.2, 0.2]], [[0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]])
    ).requires_grad_()
    teacher = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.7, 0.2, 0.1]], [[0.2, 0.6, 0.2], [0.9, 0.05, 0.05]]]))
    indices, values = teacher_top_k(teacher, 2)
    return {
        "student_logits": student_logits,
        "labels": torch.tensor([[0, 0], [1, 2]]),
        "teacher_indices": indices,
        "teacher_log_probs": values,
        "mask": torch.tensor([[1, 1], [1, 0]]),
    }


def per_token_forward_tail(data: dict[str, torch.Tensor]) -> torch.Tensor:
    """The hand computation of forward KL with a tail bucket at each position, from plain probabilities."""
    q_all = data["student_logits"].detach().softmax(-1)
    p_top = data["teacher_log_probs"].exp()
    out = torch.zeros(2, 2)
    for b in range(2):
        for t in range(2):
            idx = data["teacher_indices"][b, t].tolist()
            p = [*p_top[b, t].tolist(), 1 - p_top[b, t].sum().item()]
            q = [*(q_all[b, t, i].item() for i in idx), 1 - sum(q_all[b, t, i].item() for i in idx)]
            out[b, t] = kl(p, q)
    return out


@pytest.mark.parametrize(
    ("agg_mode", "reduce"),
    [
        ("token-mean", lambda d: (d[0, 0] + d[0, 1] + d[1, 0]) / 3),
        ("seq-mean-token-mean", lambda d: ((d[0, 0] + d[0, 1]) / 2 + d[1, 0]) / 2),
        ("seq-mean-token-sum", lambda d: ((d[0, 0] + d[0, 1]) + d[1, 0]) / 2),
        ("seq-mean-token-sum-norm", lambda d: ((d[0, 0] + d[0, 1]) / 4 + d[1, 0] / 4) / 2),
    ],
)
def test_every_aggregation_reduces_the_masked_per_token_divergence(agg_mode: str, reduce: object) -> None:
    data = two_rows()
    loss, metrics = distillation_loss(**data, kind="forward", support="tail", agg_mode=agg_mode, norm_length=4)
    expected = reduce(per_token_forward_tail(data))  # type: ignore[operator]
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["kl"].item() == pytest.approx(expected.item(), rel=1e-5)


def test_a_masked_position_changes_nothing_however_wrong_it_is() -> None:
    data = two_rows()
    loss, _ = distillation_loss(**data, kind="reverse")
    data["teacher_log_probs"] = data["teacher_log_probs"].clone()
    data["teacher_log_probs"][1, 1] = torch.tensor([-30.0, -31.0])  # the padded position
    again, _ = distillation_loss(**data, kind="reverse")
    assert again.item() == pytest.approx(loss.item(), rel=1e-6)


def test_nll_weight_adds_the_labels_negative_log_likelihood() -> None:
    data = two_rows()
    loss, metrics = distillation_loss(**data, kind="forward", nll_weight=0.5)
    nll = -(math.log(0.25) + math.log(0.6) + math.log(0.8)) / 3
    assert metrics["nll"].item() == pytest.approx(nll, rel=1e-5)
    assert loss.item() == pytest.approx(metrics["kl"].item() + 0.5 * nll, rel=1e-5)


def test_top1_agreement_counts_masked_in_positions_where_the_student_argmax_is_the_teachers() -> None:
    # Student argmax: 2, 0 | 1; teacher's top-1: 0, 0 | 1 -> 2 of 3 agree.
    _, metrics = distillation_loss(**two_rows(), kind="forward")
    assert metrics["teacher_top1_agreement"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize(("kind", "support"), [("forward", "tail"), ("reverse", "renormalized"), ("mixed", "tail")])
def test_gradients_are_those_of_the_hand_written_loss_and_vanish_on_masked_positions(kind: str, support: str) -> None:
    data = two_rows()
    loss, _ = distillation_loss(**data, kind=kind, support=support, forward_weight=0.3)
    loss.backward()
    grad = data["student_logits"].grad
    assert grad is not None and torch.count_nonzero(grad[1, 1]) == 0  # the padded position gets no gradient

    # The same loss written out with torch ops alone, differentiated by autograd.
    logits = data["student_logits"].detach().clone().requires_grad_()
    q = logits.softmax(-1).gather(-1, data["teacher_indices"])
    p = data["teacher_log_probs"].exp()
    if support == "tail":
        q, p = torch.cat([q, 1 - q.sum(-1, keepdim=True)], -1), torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1)
    else:
        q, p = q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)
    forward, reverse = (p * (p / q).log()).sum(-1), (q * (q / p).log()).sum(-1)
    per_token = {"forward": forward, "reverse": reverse, "mixed": 0.3 * forward + 0.7 * reverse}[kind]
    mask = data["mask"].float()
    ((per_token * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(grad, logits.grad, rtol=1e-4, atol=1e-6)
