"""Which training rank feeds which inference worker in a weight sync: one plan for every backend.

Devices are the global ids of a role's `device_mapping`, chunked per worker. An inference worker is
colocated with the training rank that holds its first device; that rank hands it every bucket on
the node (shared memory on CPU, CUDA IPC on GPU) and all tensor-parallel shards of the worker read
it from there. Every other worker joins one broadcast group whose rank 0 is training rank 0 and
which gives each tensor-parallel shard a rank of its own, so engines whose shards receive
directly (SGLang, vLLM with several engine processes) take part shard by shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

SyncMethod = Literal["auto", "colocated", "broadcast"]
SYNC_METHODS: tuple[str, ...] = ("auto", "colocated", "broadcast")
BROADCAST_SOURCE = 0  # the training rank that broadcasts; it is rank 0 of the broadcast group too


@dataclass(frozen=True)
class SyncPlan:
    """The routes of one weight sync.

    `colocated` maps a training rank to the inference workers it hands buckets to on its own
    devices; `broadcast_ranks` maps each remaining inference worker to its ranks in the broadcast
    group, one per tensor-parallel shard, in shard order.
    """

    colocated: dict[int, tuple[int, ...]]
    broadcast_ranks: dict[int, tuple[int, ...]]

    @property
    def broadcast_world_size(self) -> int:
        """Members of the broadcast group (the source and every shard), or 0 when no worker needs it."""
        shards = sum(len(ranks) for ranks in self.broadcast_ranks.values())
        return 1 + shards if shards else 0


def devices_per_worker(devices: Sequence[int], per_worker: int) -> list[list[int]]:
    """A role's `device_mapping` split into consecutive groups, one per worker (as the Cluster places them)."""
    return [list(devices[start : start + per_worker]) for start in range(0, len(devices), per_worker)]


def plan_weight_sync(
    train_devices: Sequence[Sequence[int]],
    infer_devices: Sequence[Sequence[int]],
    infer_tp_size: int = 1,
    method: SyncMethod = "auto",
) -> SyncPlan:
    """Route every inference worker to exactly one training rank.

    `train_devices[r]` and `infer_devices[w]` are the devices of training rank r and inference
    worker w (empty for a worker without devices). `auto` takes the colocated route wherever a
    training rank holds the worker's first device and broadcasts to the rest; `colocated` demands
    that route for every worker (ValueError naming the one without); `broadcast` sends all over the
    group.
    """
    if method not in SYNC_METHODS:
        raise ValueError(f"weight sync method {method!r} is not one of {SYNC_METHODS}")
    if infer_tp_size < 1:
        raise ValueError(f"infer_tp_size must be at least 1, got {infer_tp_size}")
    if not train_devices:
        raise ValueError("a weight sync needs at least one training rank")
    owner = {device: rank for rank, devices in enumerate(train_devices) for device in devices}
    colocated: dict[int, list[int]] = {}
    broadcast_ranks: dict[int, tuple[int, ...]] = {}
    next_rank = BROADCAST_SOURCE + 1
    for worker, devices in enumerate(infer_devices):
        source = owner.get(devices[0]) if devices and method != "broadcast" else None
        if source is not None:
            colocated.setdefault(source, []).append(worker)
            continue
        if method == "colocated":
            raise ValueError(
                f"inference worker {worker} (devices {list(devices)}) shares no device with a training rank, so it "
                "cannot take the colocated route; map it onto actor_train's devices or use weight_sync_method=auto"
            )
        broadcast_ranks[worker] = tuple(range(next_rank, next_rank + infer_tp_size))
        next_rank += infer_tp_size
    return SyncPlan({rank: tuple(workers) for rank, workers in colocated.items()}, broadcast_ranks)
