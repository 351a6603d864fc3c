"""Driver-side rollout processing (token rewards, KL penalty, advantages, dynamic sampling) and the actor's KL loss."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import TrainingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.rl_workers import ActorWorker
from roll.pipeline.base.rollout_batches import widen_prompts
from roll.pipeline.rlvr.rollout import (
    append_round,
    compute_advantages,
    consumer_row_multiple,
    informative_rows,
    keep_informative_groups,
    outcome_token_rewards,
    pad_rows,
    rollout_groups,
)


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


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_actor_kl_loss_uses_kl_loss_kind(kind: str) -> None:
    # Uniform logits over 2 tokens: every log-prob is ln(1/2). ref = ln(1/2) - 1, so d = 1 on each token:
    # k2 = 1/2, k3 = exp(-1). The penalty kind is set to k1 and must not matter.
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
    algorithm = AlgorithmArguments(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_kind=kind, kl_penalty_kind="k1")
    worker = SimpleNamespace(strategy=_OneStepStrategy(), compute_seconds=0.0)
    metrics = ActorWorker.train_step(worker, batch, algorithm)
    assert metrics["kl_loss"] == pytest.approx(0.5 if kind == "k2" else math.exp(-1.0))


# --- dynamic sampling -------------------------------------------------------------------------------------


def _role(world_size: int, micro: int = 1, accumulation: int = 1) -> WorkerConfig:
    args = TrainingArguments(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
    return WorkerConfig(world_size=world_size, training_args=args)


def _grouped_batch(group_scores: list[list[float]]) -> tuple[DataProto, torch.Tensor]:
    scores = torch.tensor([s for group in group_scores for s in group])
    group_index = torch.arange(len(group_scores)).repeat_interleave(len(group_scores[0]))
    return DataProto.from_dict(tensors={"scores": scores, "row": torch.arange(len(scores))}), group_index


def test_consumer_row_multiple() -> None:
    # actor_train: micro 2 x accumulation 2 x dp 1 = 4 rows per optimizer step; reference dp 2; critic dp 3
    # with micro 1 x accumulation 1 -> 3 rows per step. lcm(4, 2, 3) = 12.
    assert consumer_row_multiple([_role(1, 2, 2)], []) == 4
    assert consumer_row_multiple([_role(1, 2, 2), _role(3)], [_role(2)]) == 12
    assert consumer_row_multiple([_role(2, 1, 1)], [_role(4)]) == 4


def test_dynamic_sampling_keeps_whole_optimizer_steps_of_whole_groups() -> None:
    # 4 prompts x 3 samples, 4 rows per optimizer step, group 2 constant: 9 informative rows. A multiple of
    # both 4 and 3 is needed (12), so nothing is kept rather than a batch the update would reject.
    batch, group_index = _grouped_batch([[1, 0, 0], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    kept, kept_index, metrics = keep_informative_groups(batch, group_index, 4)
    assert len(kept) == 0 and len(kept_index) == 0
    assert metrics["rollout/informative_groups"] == 3.0
    assert metrics["rollout/kept_fraction"] == 0.0
    # 8 prompts x 3 with group 2 constant: 7 informative groups, 4 of them (12 rows) kept, from the front.
    batch, group_index = _grouped_batch([[1, 0, 0], [0, 1, 1], [1, 1, 1], *[[0, 0, 1]] * 5])
    kept, kept_index, metrics = keep_informative_groups(batch, group_index, 4)
    assert kept.batch["row"].tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14]
    assert kept_index.tolist() == [0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 4]
    assert metrics["rollout/kept_fraction"] == pytest.approx(0.5)


def test_dynamic_sampling_respects_a_reference_dp_size() -> None:
    # Groups of 3, actor_train 2 rows per step (dp 2), reference dp 4: the multiple is lcm(2, 4, 3) = 12, i.e.
    # 4 groups. Six informative groups (18 rows, which 4 reference ranks cannot split) -> the first four kept.
    batch, group_index = _grouped_batch([[0, 1, 1], [1, 1, 1], *[[1, 0, 0]] * 6])
    multiple = consumer_row_multiple([_role(2)], [_role(4)])
    kept, kept_index, _ = keep_informative_groups(batch, group_index, multiple)
    assert kept_index.tolist() == [0, 0, 0, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert kept.batch["row"].tolist() == [0, 1, 2, *range(6, 15)]


def test_dynamic_sampling_judges_groups_before_the_overlong_penalty() -> None:
    # Group 0 is all correct, but one sample's overlong penalty made its score differ: DAPO keeps only group 1.
    batch, group_index = _grouped_batch([[1.0, 0.5], [1.0, 0.0]])
    batch.batch["verifier_scores"] = torch.tensor([1.0, 1.0, 1.0, 0.0])
    kept, kept_index, metrics = keep_informative_groups(batch, group_index, 2)
    assert kept.batch["row"].tolist() == [2, 3] and kept_index.tolist() == [1, 1]
    assert metrics["rollout/informative_groups"] == 1.0


def test_dynamic_sampling_caps_a_refilled_batch_at_its_target() -> None:
    # Two rounds of 3 groups of 2 gave 5 informative groups; a target of 6 rows keeps the first three groups.
    batch, group_index = _grouped_batch([[0, 1], [1, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    _, kept_index, _ = keep_informative_groups(batch, group_index, 2, max_rows=6)
    assert kept_index.tolist() == [0, 0, 2, 2, 3, 3]
    assert informative_rows(batch, group_index) == 10


def _segment_rows(episode_index: list[int], scores: list[float], prompt_width: int) -> DataProto:
    rows = len(scores)
    return DataProto.from_dict(
        tensors={
            "episode_index": torch.tensor(episode_index),
            "scores": torch.tensor(scores),
            "prompts": torch.ones(rows, prompt_width, dtype=torch.long),
            "input_ids": torch.ones(rows, prompt_width + 2, dtype=torch.long),
            "attention_mask": torch.ones(rows, prompt_width + 2, dtype=torch.long),
            "response_mask": torch.ones(rows, 2, dtype=torch.long),
            "reward_failed": torch.zeros(rows),
            "row": torch.arange(rows),
        }
    )


def test_dynamic_sampling_keeps_whole_groups_of_agent_episodes_of_several_rows() -> None:
    # Groups of 2 episodes; a round's episode 0 (round 1) and episode 1 (round 2) have two segments (rows).
    # Round 1: group 0 scores (1, 0), informative, 3 rows; group 1 constant. Round 2: group 0 (1, 0), 3 rows.
    first = _segment_rows([0, 0, 1, 2, 3], [1.0, 1.0, 0.0, 0.0, 0.0], prompt_width=2)
    more = _segment_rows([0, 1, 1, 2, 3], [1.0, 0.0, 0.0, 0.0, 0.0], prompt_width=3)
    groups = rollout_groups(first, 2)
    assert groups.tolist() == [0, 0, 0, 1, 1]
    batch, groups = append_round(first, groups, more, 2, pad_id=0)
    assert batch.batch["episode_index"].tolist() == [0, 0, 1, 2, 3, 4, 5, 5, 6, 7]
    assert groups.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3] and batch.batch["prompts"].shape[1] == 3
    # At most 5 rows: the first informative group (3 rows) fits, the second would not; then padded to 4 rows, the
    # padding row (a copy of row 0, an episode and group of its own) between the episodes.
    kept, kept_groups, metrics = keep_informative_groups(batch, groups, 4, max_rows=5)
    assert kept.batch["row"].tolist() == [0, 1, 2] and metrics["rollout/informative_groups"] == 2.0
    padded, padded_groups = pad_rows(kept, kept_groups, 4)
    assert padded_groups.tolist() == [0, 0, 1, 0] and padded.batch["episode_index"].tolist() == [0, 0, 2, 1]
    assert padded.batch["row"].tolist() == [0, 1, 0, 2] and padded.batch["reward_failed"].tolist() == [0, 0, 1, 0]
    assert padded.batch["response_mask"].sum(-1).tolist() == [2, 2, 0, 2]
    assert pad_rows(padded, padded_groups, 4)[0] is padded


def test_padding_rows_spread_over_the_optimizer_steps() -> None:
    # 9 one-row episodes padded to 16 rows (two optimizer steps of 8): the 7 padding rows go between them, so each
    # step holds 4 or 5 real rows instead of 8 and 1.
    batch = _segment_rows(list(range(9)), [1.0] * 9, prompt_width=2)
    padded, _ = pad_rows(batch, torch.arange(9), 16)
    real = 1 - padded.batch["reward_failed"]
    assert len(padded) == 16 and {real[:8].sum().item(), real[8:].sum().item()} == {4.0, 5.0}
    assert padded.batch["row"][real.bool()].tolist() == list(range(9))  # the real rows keep their order


def test_prompts_widen_on_the_left_so_rollouts_concatenate() -> None:
    rollout = DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([[5, 6]]),
            "input_ids": torch.tensor([[5, 6, 7, 0]]),
            "attention_mask": torch.tensor([[1, 1, 1, 0]]),
            "responses": torch.tensor([[7, 0]]),
        }
    )
    wide = widen_prompts(rollout, 4, pad_id=0)
    assert wide.batch["prompts"].tolist() == [[0, 0, 5, 6]]
    assert wide.batch["input_ids"].tolist() == [[0, 0, 5, 6, 7, 0]]
    assert wide.batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 0]]
    assert wide.batch["responses"].tolist() == [[7, 0]]
    assert widen_prompts(rollout, 2, pad_id=0) is rollout
