"""Driver-side rollout processing (token rewards, KL penalty, advantages, dynamic sampling) and the actor's KL loss."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll.configs.algorithm_config import AlgorithmArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base_worker import ActorWorker
from roll.pipeline.rlvr.rollout import compute_advantages, outcome_token_rewards


def close(actual: torch.Tensor, expected: object, atol: float = 1e-6) -> None:
    """`actual` equals `expected` (a tensor or nested lists/numbers) within `atol`."""
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- empty responses --------------------------------------------------------------------------------------

# One group of three: scores 1, 0 and -1, the last response empty (no token in its mask).
EMPTY_GROUP_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
EMPTY_GROUP_SCORES = torch.tensor([1.0, 0.0, -1.0])


def _empty_group_batch(**extra: torch.Tensor) -> DataProto:
    return DataProto.from_dict(tensors={"response_mask": EMPTY_GROUP_MASK, "scores": EMPTY_GROUP_SCORES, **extra})


def test_outcome_token_rewards_keep_the_score_of_an_empty_response() -> None:
    token_rewards = outcome_token_rewards(EMPTY_GROUP_SCORES, EMPTY_GROUP_MASK)
    close(token_rewards, [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    close(token_rewards.sum(-1), [1.0, 0.0, -1.0])


@pytest.mark.parametrize("with_kl", [False, True])
def test_empty_response_score_counts_in_its_group(with_kl: bool) -> None:
    # GRPO: mean 0, unbiased std 1 -> [1, 0, -1] (ignoring the -1 would give scores [1, 0, 0] and 2/sqrt(3) for row 0).
    # RLOO: 1 - mean(0, -1) = 1.5, 0 - mean(1, -1) = 0. The empty row has no token to carry its advantage.
    # With the KL penalty, d = 0 on every token: the penalty is 0 and must not erase the empty row's score.
    extra = {"old_log_probs": torch.full((3, 3), -1.0), "ref_log_probs": torch.full((3, 3), -1.0)} if with_kl else {}
    group_index = torch.zeros(3, dtype=torch.long)
    for estimator, first in (("grpo", 1.0), ("rloo", 1.5)):
        algorithm = AlgorithmArguments(adv_estimator=estimator, kl_penalty_coef=0.1 if with_kl else 0.0)
        batch, _ = compute_advantages(_empty_group_batch(**extra), group_index, algorithm, kl_coef=0.1)
        close(batch.batch["advantages"], [[first, first, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


# --- separate KL kinds for the penalty and the loss -------------------------------------------------------


def test_kl_penalty_uses_kl_penalty_kind() -> None:
    # d = logp - ref = 1 on row 0's two tokens: k1 = 1, k3 = exp(-1). Coefficient 0.5, no normalisation:
    # token rewards [0 - 0.5 * kl, 1 - 0.5 * kl]; mean KL of the row = kl.
    mask = torch.tensor([[1, 1], [1, 1]])
    batch = DataProto.from_dict(
        tensors={
            "response_mask": mask,
            "scores": torch.tensor([1.0, 0.0]),
            "old_log_probs": torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]),
            "ref_log_probs": torch.tensor([[-2.0, -2.0], [-1.0, -1.0]]),
        }
    )
    group_index = torch.zeros(2, dtype=torch.long)
    for kind, kl in (("k1", 1.0), ("k3", math.exp(-1.0))):
        other = "k3" if kind == "k1" else "k1"
        algorithm = AlgorithmArguments(kl_penalty_coef=0.5, kl_penalty_kind=kind, kl_loss_kind=other)
        out, metrics = compute_advantages(batch, group_index, algorithm, kl_coef=0.5)
        close(out.batch["token_rewards"], [[-0.5 * kl, 1.0 - 0.5 * kl], [0.0, 0.0]])
        assert metrics["actor/kl"] == pytest.approx(kl / 2)


class _OneStepStrategy:
    """Runs the loss function once on the whole batch with uniform logits over a vocabulary of 2."""

    def train_step(self, batch: DataProto, loss_func: Any) -> dict[str, float]:
        logits = torch.zeros(*batch.batch["input_ids"].shape, 2)
        _, metrics = loss_func(batch, SimpleNamespace(logits=logits))
        return {key: float(value) for key, value in metrics.items()}


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_actor_kl_loss_uses_kl_loss_kind(kind: str) -> None:
    # Uniform logits over 2 tokens: every log-prob is ln(1/2). ref = ln(1/2) - 1, so d = 1 on each token:
    # k1 = 1, k3 = exp(-1). The penalty kind is set to the other one and must not matter.
    half = math.log(0.5)
    batch = DataProto.from_dict(
        tensors={
            "input_ids": torch.tensor([[0, 1, 0, 1]]),
            "responses": torch.tensor([[0, 1]]),
            "response_mask": torch.tensor([[1, 1]]),
            "old_log_probs": torch.full((1, 2), half),
            "ref_log_probs": torch.full((1, 2), half - 1.0),
            "advantages": torch.zeros(1, 2),
        }
    )
    algorithm = AlgorithmArguments(
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_kind=kind, kl_penalty_kind="k3" if kind == "k1" else "k1"
    )
    worker = SimpleNamespace(strategy=_OneStepStrategy(), compute_seconds=0.0)
    metrics = ActorWorker.train_step(worker, batch, algorithm)
    assert metrics["kl_loss"] == pytest.approx(1.0 if kind == "k1" else math.exp(-1.0))
