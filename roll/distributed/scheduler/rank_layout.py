"""Where each rank of a cluster sits in its data-, tensor- and pipeline-parallel grid."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """A rank's coordinates. Ranks of one data-parallel group share `dp_rank` and see the same data."""

    rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def is_dp_lead(self) -> bool:
        """The rank that returns its group's output: first tensor rank of the last pipeline stage."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1


def rank_layout(world_size: int, tp_size: int = 1, pp_size: int = 1) -> list[RankInfo]:
    """Coordinates of every rank, tensor-parallel ranks innermost, then pipeline, then data.

    This is the usual Megatron-style order: rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank.
    """
    group = tp_size * pp_size
    if tp_size < 1 or pp_size < 1 or world_size % group:
        raise ValueError(f"world size {world_size} is not a multiple of tp {tp_size} x pp {pp_size}")
    dp_size = world_size // group
    return [
        RankInfo(
            rank=rank,
            dp_rank=rank // group,
            dp_size=dp_size,
            tp_rank=rank % tp_size,
            tp_size=tp_size,
            pp_rank=(rank // tp_size) % pp_size,
            pp_size=pp_size,
        )
        for rank in range(world_size)
    ]
