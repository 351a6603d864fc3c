"""WorkerHost actors kept for a test session: strategy tests start their roles' ranks in them, not in new actors.

A new worker process spends seconds of CPU importing torch, transformers and DeepSpeed, more than the few
training steps a strategy test runs. A pooled host serves one device slot; a slot gets a second host only
while its first serves a role that is still running (a trainer and an engine side by side keep processes of
their own, as they would without the pool). Before a host that served a role takes the next one, it must be
clean (`WorkerHost.leftovers`): a dirty host fails the test that wanted it and is replaced, so the tests after
it start clean again.

The hosts hold no Ray resources: the test module's ResourceManager still places each role (its ranks'
variables and thread caps); only the processes come from the pool. An idle host holds about 0.6 GB (the
libraries it imported), so after each test file only the hosts most files use stay (`trim`).
"""

from __future__ import annotations

import ray

from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.actor_exit import end_actors
from roll.distributed.executor.cluster import Cluster
from roll.distributed.executor.worker_host import WorkerHost
from roll.distributed.scheduler.resource_manager import ResourceManager

HostKey = tuple[int, int]  # (device slot, lane): lane n is the slot's (n+1)-th host
# The hosts kept between test files: one for each of the two device slots nearly every strategy test uses.
KEPT_HOSTS = frozenset({(0, 0), (1, 0)})


class HostPool:
    """Pooled WorkerHosts by device slot, created when first needed and killed by `close`."""

    def __init__(self) -> None:
        self.hosts: dict[HostKey, ray.actor.ActorHandle] = {}
        self.users: dict[HostKey, Cluster] = {}  # the last cluster started in each host

    def start(self, worker_cls: str, config: WorkerConfig, manager: ResourceManager) -> Cluster:
        """A cluster of `config`'s role (resolved) with each rank in a clean, idle host of its first device slot."""
        keys = [self._idle_host(placement.place.devices[0]) for placement in manager.place(config)]
        self._require_clean(keys)
        cluster = Cluster(worker_cls, config, manager, [self.hosts[key] for key in keys])
        self.users.update(dict.fromkeys(keys, cluster))
        return cluster

    def _idle_host(self, slot: int) -> HostKey:
        """The first host of `slot` whose last cluster was shut down (a new one if every host is busy)."""
        lane = 0
        while (user := self.users.get((slot, lane))) is not None and user.workers:
            lane += 1
        if (slot, lane) not in self.hosts:
            self.hosts[(slot, lane)] = ray.remote(WorkerHost).options(num_cpus=0).remote()
        return slot, lane

    def _require_clean(self, keys: list[HostKey]) -> None:
        """Raise AssertionError naming what the previous roles left in any of these hosts, after replacing them."""
        found = ray.get([self.hosts[key].leftovers.remote() for key in keys])
        dirty = {key: leftovers for key, leftovers in zip(keys, found, strict=True) if leftovers}
        for key in dirty:
            ray.kill(self.hosts.pop(key), no_restart=True)
            self.users.pop(key, None)
        if dirty:
            described = "; ".join(f"slot {slot} lane {lane}: {', '.join(left)}" for (slot, lane), left in dirty.items())
            raise AssertionError(f"pooled worker hosts are not clean after their last role: {described}")

    def trim(self) -> None:
        """Check every idle host is clean (AssertionError if not), then kill the idle ones outside KEPT_HOSTS."""
        idle = [key for key in self.hosts if not (key in self.users and self.users[key].workers)]
        self._require_clean(idle)
        leaving = [key for key in idle if key not in KEPT_HOSTS]
        end_actors([self.hosts.pop(key) for key in leaving])
        for key in leaving:
            self.users.pop(key, None)

    def close(self) -> None:
        """Check every host is clean (AssertionError if not), then kill them all."""
        try:
            self._require_clean(list(self.hosts))
        finally:
            end_actors(list(self.hosts.values()))
            self.hosts.clear()
            self.users.clear()
