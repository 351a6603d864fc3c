"""Token-budget micro-batch planning, trimming, row-order restoration, and the pack/unpack round trip."""

from __future__ import annotations

import pytest
import torch

from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.micro_batches import TokenBudget, plan_micro_batches, restore_rows
from roll.utils.micro_batch_plan import padded_cost, plan_by_token_budget, split_to_count
from roll.utils.sequence_packing import pack_rows, unpack_rows
from tests.padded_rollouts import padded_rollout

PROMPTS = [3, 1, 4, 2, 4, 1]
RESPONSES = [5, 0, 2, 6, 1, 3]


def _check_partition(groups: list[list[int]], rows: int) -> None:
    assert sorted(i for group in groups for i in group) == list(range(rows))
    assert all(group == sorted(group) and group for group in groups)


def test_padded_plan_keeps_every_group_within_the_budget_and_groups_similar_lengths() -> None:
    groups = plan_by_token_budget(PROMPTS, RESPONSES, max_tokens=16, packed=False)
    _check_partition(groups, len(PROMPTS))
    assert all(padded_cost(PROMPTS, RESPONSES, group) <= 16 for group in groups)
    # Longest first. Rows 0 (3 + 5) and 3 (2 + 6) cannot share: padded to 3 + 6 each they cost 18.
    assert groups == [[0], [3], [2, 4], [1, 5]]


def test_packed_plan_sums_lengths_within_the_budget() -> None:
    groups = plan_by_token_budget(PROMPTS, RESPONSES, max_tokens=12, packed=True)
    _check_partition(groups, len(PROMPTS))
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert all(sum(lengths[i] for i in group) <= 12 for group in groups)
    assert len(groups) == -(-sum(lengths) // 12)  # 32 tokens in 3 rows of 12: first-fit decreasing is tight here


def test_a_row_longer_than_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="row 0 has 8 real tokens, more than the budget of 7"):
        plan_by_token_budget(PROMPTS, RESPONSES, max_tokens=7, packed=True)


def test_split_to_count_halves_the_largest_group_until_the_count_is_reached() -> None:
    groups = split_to_count([[0, 1, 2, 3], [4]], 4)
    assert groups == [[0], [1], [2, 3], [4]]
    with pytest.raises(ValueError, match="cannot form 3"):
        split_to_count([[0], [1]], 3)


def _batch() -> DataProto:
    """Left-padded prompts (width 4) and right-padded responses (width 6) of the lengths above."""
    tensors, generator = padded_rollout(PROMPTS, RESPONSES, (4, 6), vocab=50, seed=0)
    tensors["advantages"] = torch.randn(len(PROMPTS), 6, generator=generator) * tensors["response_mask"]
    tensors["scores"] = torch.arange(len(PROMPTS), dtype=torch.float32)
    return DataProto.from_dict(tensors=tensors)


@pytest.mark.parametrize("packing", [False, True])
def test_budgeted_micro_batches_are_trimmed_and_outputs_come_back_in_row_order(packing: bool) -> None:
    batch = _batch()
    micro_batches = plan_micro_batches(batch, 2, TokenBudget(max_tokens=12, packing=packing))
    assert sorted(row for mb in micro_batches for row in mb.rows) == list(range(len(batch)))
    outputs = []
    for mb in micro_batches:
        data = mb.data.batch
        rows = torch.tensor(mb.rows)
        # Trimmed to the longest real prompt and response of its rows, nothing attended is cut.
        assert data["input_ids"].shape[1] == max(PROMPTS[r] for r in mb.rows) + max(
            max(RESPONSES[r] for r in mb.rows), 1
        )
        assert data["attention_mask"].sum() == batch.batch["attention_mask"][rows].sum()
        assert torch.equal(data["advantages"].sum(1), batch.batch["advantages"][rows].sum(1))
        assert data["responses"].shape[1] == data["response_mask"].shape[1] == data["advantages"].shape[1]
        outputs.append({"advantages": data["advantages"], "ids": data["input_ids"], "scores": data["scores"]})
    restored = restore_rows(micro_batches, outputs, batch)
    assert torch.equal(restored["advantages"], batch.batch["advantages"])
    assert torch.equal(restored["ids"], batch.batch["input_ids"])
    assert torch.equal(restored["scores"], batch.batch["scores"])


def test_without_a_budget_micro_batches_are_consecutive_fixed_size_rows() -> None:
    batch = _batch()
    micro_batches = plan_micro_batches(batch, 4, None)
    assert [mb.rows for mb in micro_batches] == [[0, 1, 2, 3], [4, 5]]
    assert all(mb.data.batch["input_ids"].shape[1] == 10 and not mb.packed for mb in micro_batches)


def test_pack_unpack_round_trip_restarts_positions_and_keeps_only_attended_tokens() -> None:
    batch = _batch()
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    packing = pack_rows(ids, mask, positions)
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert packing.input_ids.shape == (1, sum(lengths))
    expected_positions = torch.cat([torch.arange(n) for n in lengths])
    assert torch.equal(packing.position_ids[0], expected_positions)
    assert packing.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packing.max_length == max(lengths)
    # A per-token output (here the ids themselves, with a feature dim) comes back in the padded layout.
    unpacked = unpack_rows(packing.input_ids.unsqueeze(-1).float(), packing)
    assert torch.equal(unpacked[..., 0], (ids * mask).float())
    # Gradients flow back through the gather to exactly the packed positions.
    packed = torch.ones(1, sum(lengths), 2, requires_grad=True)
    unpack_rows(packed, packing).sum().backward()
    assert torch.equal(packed.grad, torch.ones_like(packed))
