"""The driver's side of a weight sync: start every route of a SyncPlan at once and wait for all of them.

Training ranks run `StrategyWorker.send_weights` (all of them: ZeRO-3 gathers each parameter
collectively); each hands buckets to its colocated inference workers, and training rank 0 also
feeds the broadcast group, whose receiving workers run `receive_weight_broadcast` meanwhile.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from roll.distributed.executor.cluster import Cluster
from roll.distributed.weight_sync.plan import BROADCAST_SOURCE, SyncPlan


def get_all(refs: list[ray.ObjectRef]) -> list[Any]:
    """Results of every call, raising the first failure as soon as it happens (not after the others finish)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(refs)


class WeightSyncer:
    """Moves a training cluster's weights into an inference cluster along `plan`, in buckets of `bucket_bytes`."""

    def __init__(self, train: Cluster, infer: Cluster, plan: SyncPlan, bucket_bytes: int) -> None:
        self.train, self.infer, self.plan, self.bucket_bytes = train, infer, plan, bucket_bytes
        if plan.broadcast_ranks:
            self._open_broadcast_group()

    def _open_broadcast_group(self) -> None:
        source = self.train.workers[BROADCAST_SOURCE]
        address, port = ray.get(source.node_address_and_free_port.remote())
        world_size = self.plan.broadcast_world_size
        receivers = [ranks[0] for ranks in self.plan.broadcast_ranks.values()]
        # Every member must be joining at the same time: the group forms only when all have arrived.
        target = self.infer.name
        refs = [source.open_weight_broadcast.remote(target, address, port, world_size, (BROADCAST_SOURCE,), receivers)]
        refs += [
            self.infer.workers[worker].open_weight_broadcast.remote(target, address, port, world_size, ranks, [])
            for worker, ranks in self.plan.broadcast_ranks.items()
        ]
        get_all(refs)

    def sync(self) -> dict[str, float]:
        """One full sync; return the bytes each route carried and the seconds it took."""
        started = time.perf_counter()
        sends = [
            worker.send_weights.remote(
                self.bucket_bytes,
                [self.infer.workers[w] for w in self.plan.colocated.get(rank, ())],
                self.infer.name if rank == BROADCAST_SOURCE and self.plan.broadcast_ranks else None,
            )
            for rank, worker in enumerate(self.train.workers)
        ]
        receives = [self.infer.workers[w].receive_weight_broadcast.remote() for w in self.plan.broadcast_ranks]
        results = get_all(sends + receives)
        seconds = time.perf_counter() - started
        colocated = sum(result["colocated_bytes"] for result in results[: len(sends)])
        broadcast = results[BROADCAST_SOURCE]["broadcast_bytes"]
        return {
            "sync/colocated_bytes": float(colocated),
            "sync/broadcast_bytes": float(broadcast),
            "sync/seconds": seconds,
        }
