"""The driver's side of a weight sync: start every route of a SyncPlan at once and wait for all of them.

Every training rank runs `StrategyWorker.send_weights` (ZeRO-3 gathers each parameter
collectively); each hands buckets to its colocated inference workers, and training rank 0 also
feeds the broadcast group, whose receiving workers run `receive_weight_broadcast` meanwhile.
All of it goes through the clusters' registered methods. A failed sync ends every participant:
the failing side tells the others (an abort header, the remaining ZeRO-3 gathers taken part in),
and any worker still waiting after `abort_grace_s` is stopped, so the driver raises instead of
hanging.
"""

from __future__ import annotations

import time

from roll.distributed.executor.cluster import Cluster, get_all
from roll.distributed.weight_sync.plan import BROADCAST_SOURCE, SyncPlan


class WeightSyncer:
    """Moves a training cluster's weights into an inference cluster along `plan`, in buckets of `bucket_bytes`."""

    def __init__(
        self, train: Cluster, infer: Cluster, plan: SyncPlan, bucket_bytes: int, abort_grace_s: float = 30.0
    ) -> None:
        self.train, self.infer, self.plan, self.bucket_bytes = train, infer, plan, bucket_bytes
        self.abort_grace_s = abort_grace_s
        if plan.broadcast_ranks:
            self._open_broadcast_group()

    def _open_broadcast_group(self) -> None:
        address, port = self.train.host_broadcast_store(self.infer.name)
        world_size = self.plan.broadcast_world_size
        receivers = [ranks[0] for ranks in self.plan.broadcast_ranks.values()]
        n = self.infer.world_size
        member_ranks = [self.plan.broadcast_ranks.get(worker) for worker in range(n)]
        # Every member must be joining at the same time: the group forms only when all have arrived.
        get_all(
            self.train.open_broadcast_source(self.infer.name, world_size, receivers, blocking=False),
            self.infer.join_weight_broadcast([address] * n, [port] * n, [world_size] * n, member_ranks, blocking=False),
        )

    def sync(self) -> dict[str, float]:
        """One full sync; return the bytes each route carried and the seconds it took."""
        started = time.perf_counter()
        ranks = range(self.train.world_size)
        colocated = [[self.infer.workers[w] for w in self.plan.colocated.get(rank, ())] for rank in ranks]
        target = self.infer.name if self.plan.broadcast_ranks else None
        broadcast_to = [target if rank == BROADCAST_SOURCE else None for rank in ranks]
        sent, _ = get_all(
            self.train.send_weights([self.bucket_bytes] * len(ranks), colocated, broadcast_to, blocking=False),
            self.infer.receive_weight_broadcast(blocking=False),
            abort_grace_s=self.abort_grace_s,
        )
        return {
            "sync/colocated_bytes": float(sum(result["colocated_bytes"] for result in sent)),
            "sync/broadcast_bytes": float(sent[BROADCAST_SOURCE]["broadcast_bytes"]),
            "sync/seconds": time.perf_counter() - started,
        }
