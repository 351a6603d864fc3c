"""Dispatch modes and rank layouts as pure functions (no Ray)."""

from __future__ import annotations

import pytest
import torch

from roll.distributed.scheduler.decorator import Dispatch, collect_results, dispatch_args
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.rank_layout import rank_layout


def rows(n: int) -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(n)})


def test_rank_layout_tp_innermost() -> None:
    layout = rank_layout(8, tp_size=2, pp_size=2)
    assert [(r.dp_rank, r.pp_rank, r.tp_rank) for r in layout[:4]] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]
    assert layout[4].dp_rank == 1 and layout[0].dp_size == 2
    assert [r.rank for r in layout if r.is_dp_lead] == [2, 6]  # tp rank 0 of the last stage


def test_rank_layout_rejects_uneven_grid() -> None:
    with pytest.raises(ValueError, match="not a multiple of tp 2 x pp 2"):
        rank_layout(6, tp_size=2, pp_size=2)


def test_dp_compute_splits_by_dp_rank_and_gathers_from_leads() -> None:
    layout = rank_layout(4, tp_size=2)
    calls = dispatch_args(Dispatch.DP_COMPUTE, layout, (rows(6), "shared"), {})
    assert [rank for rank, _, _ in calls] == [0, 1, 2, 3]
    shards = [args[0].batch["x"].tolist() for _, args, _ in calls]
    assert shards == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]  # tp peers see the same shard
    assert all(args[1] == "shared" for _, args, _ in calls)
    outputs = [rows(3), DataProto.from_dict(tensors={"x": -torch.ones(3)}), rows(3), rows(3)]
    gathered = collect_results(Dispatch.DP_COMPUTE, layout, [0, 1, 2, 3], outputs)
    assert len(gathered) == 6 and (gathered.batch["x"] >= 0).all()  # the non-lead output was dropped


def test_dp_compute_uneven_batch_is_an_error() -> None:
    with pytest.raises(ValueError, match="a batch of 5 does not split over 2 data-parallel ranks"):
        dispatch_args(Dispatch.DP_COMPUTE, rank_layout(2), (rows(5),), {})


def test_all_to_all_and_rank0() -> None:
    layout = rank_layout(3)
    calls = dispatch_args(Dispatch.ALL_TO_ALL, layout, ([10, 11, 12],), {"k": ["a", "b", "c"]})
    assert [(a, kw) for _, a, kw in calls] == [((10,), {"k": "a"}), ((11,), {"k": "b"}), ((12,), {"k": "c"})]
    with pytest.raises(ValueError, match="list of 3 per-rank values"):
        dispatch_args(Dispatch.ALL_TO_ALL, layout, ([1, 2],), {})
    assert dispatch_args(Dispatch.RANK0, layout, (1,), {}) == [(0, (1,), {})]
    assert collect_results(Dispatch.RANK0, layout, [0], ["only"]) == "only"
