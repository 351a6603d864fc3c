"""`@register` and the dispatch modes that turn a worker method into a cluster method.

A dispatch mode says how one driver call fans out to the ranks of a cluster and how their results
come back: the same arguments to every rank, a DataProto split by data-parallel rank, rank 0 only,
or one argument per rank.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.rank_layout import RankInfo

F = TypeVar("F", bound=Callable[..., Any])
DISPATCH_ATTR = "_roll_dispatch_mode"


class Dispatch(enum.Enum):
    """How a cluster method distributes its arguments and collects results."""

    ONE_TO_ALL = "one_to_all"  # same arguments to every rank; a list of every rank's result
    DP_COMPUTE = "dp_compute"  # DataProto arguments split by dp rank; results of dp-group leads, concatenated
    RANK0 = "rank0"  # only rank 0 runs; its result
    ALL_TO_ALL = "all_to_all"  # each argument is a list with one entry per rank; a list of results


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL) -> Callable[[F], F]:
    """Mark a Worker method as callable on the whole cluster with `dispatch_mode`.

    The method's running time inside the worker is added to the worker's `compute_seconds`, so
    the driver can tell the work done from the framework's own overhead (dispatch, transport).
    """

    def mark(fn: F) -> F:
        @functools.wraps(fn)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.compute_seconds += time.perf_counter() - started

        setattr(timed, DISPATCH_ATTR, dispatch_mode)
        return timed  # type: ignore[return-value]

    return mark


# How one call fans out: (rank layout, args, kwargs) -> the (rank, args, kwargs) of each rank called.
DispatchFn = Callable[[list[RankInfo], tuple, dict], list[tuple[int, tuple, dict]]]
# How the results come back: (rank layout, ranks called, their results in that order) -> the result.
CollectFn = Callable[[list[RankInfo], list[int], list[Any]], Any]


def _to_rank0(ranks: list[RankInfo], args: tuple, kwargs: dict) -> list[tuple[int, tuple, dict]]:
    return [(0, args, kwargs)]


def _to_all(ranks: list[RankInfo], args: tuple, kwargs: dict) -> list[tuple[int, tuple, dict]]:
    return [(r.rank, args, kwargs) for r in ranks]


def _one_per_rank(ranks: list[RankInfo], args: tuple, kwargs: dict) -> list[tuple[int, tuple, dict]]:
    world = len(ranks)
    for value in (*args, *kwargs.values()):
        if not isinstance(value, list | tuple) or len(value) != world:
            raise ValueError(f"ALL_TO_ALL needs every argument as a list of {world} per-rank values")
    return [(r.rank, tuple(a[r.rank] for a in args), {k: v[r.rank] for k, v in kwargs.items()}) for r in ranks]


def _split_by_dp(ranks: list[RankInfo], args: tuple, kwargs: dict) -> list[tuple[int, tuple, dict]]:
    dp_size = ranks[0].dp_size
    split_args = [_split_for_dp(a, dp_size) for a in args]
    split_kwargs = {k: _split_for_dp(v, dp_size) for k, v in kwargs.items()}
    return [
        (r.rank, tuple(a[r.dp_rank] for a in split_args), {k: v[r.dp_rank] for k, v in split_kwargs.items()})
        for r in ranks
    ]


def _split_for_dp(value: Any, dp_size: int) -> list[Any]:
    if not isinstance(value, DataProto):
        return [value] * dp_size
    if len(value) % dp_size:
        raise ValueError(
            f"a batch of {len(value)} does not split over {dp_size} data-parallel ranks; "
            f"pad it with DataProto.pad_to_divisor({dp_size}) or fix the batch size in the config"
        )
    return value.chunk(dp_size)


def _first(ranks: list[RankInfo], called: list[int], results: list[Any]) -> Any:
    return results[0]


def _every(ranks: list[RankInfo], called: list[int], results: list[Any]) -> list[Any]:
    return results


def _dp_leads_concatenated(ranks: list[RankInfo], called: list[int], results: list[Any]) -> Any:
    by_rank = dict(zip(called, results, strict=True))
    leads = sorted((r for r in ranks if r.is_dp_lead), key=lambda r: r.dp_rank)
    outputs = [by_rank[r.rank] for r in leads]
    if outputs and all(isinstance(o, DataProto) for o in outputs):
        return DataProto.concat(outputs)
    return outputs


DISPATCH_TABLE: dict[Dispatch, tuple[DispatchFn, CollectFn]] = {
    Dispatch.ONE_TO_ALL: (_to_all, _every),
    Dispatch.DP_COMPUTE: (_split_by_dp, _dp_leads_concatenated),
    Dispatch.RANK0: (_to_rank0, _first),
    Dispatch.ALL_TO_ALL: (_one_per_rank, _every),
}


def dispatch_args(mode: Dispatch, ranks: list[RankInfo], args: tuple, kwargs: dict) -> list[tuple[int, tuple, dict]]:
    """Per-rank `(rank, args, kwargs)` for one cluster call; ranks not listed are not called."""
    return DISPATCH_TABLE[mode][0](ranks, args, kwargs)


def collect_results(mode: Dispatch, ranks: list[RankInfo], called: list[int], results: list[Any]) -> Any:
    """Combine the results of the ranks in `called` (same order) the way `mode` promises."""
    return DISPATCH_TABLE[mode][1](ranks, called, results)
