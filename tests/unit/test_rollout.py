"""Driver-side rollout processing (token rewards, KL penalty, advantages, dynamic sampling) and the actor's KL loss."""

from __future__ import annotations

import pytest
import torch

from roll.configs.algorithm_config import AlgorithmArguments
from roll.distributed.scheduler.protocol import DataProto
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
