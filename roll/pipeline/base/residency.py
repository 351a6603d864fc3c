"""Which roles' model states a phase needs on its devices, and moving them there.

Colocated roles take turns on shared devices: entering a phase loads the states of the roles it
needs and offloads the roles that share their devices but are not needed. Nothing moves for roles
on devices of their own, and roles whose offload can move nothing (states already in host memory on a
CPU platform, an engine that cannot sleep) are not called: a round trip each, per phase, that did
nothing. Every pipeline with colocated roles (RLVR, DPO, distillation) names its phases and enters
them through one `Residency`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.cluster import Cluster


@dataclass(frozen=True)
class Phase:
    """A named part of a step and the roles whose model states must be resident for it."""

    name: str
    resident: frozenset[str] = field(default_factory=frozenset)


def phase(name: str, *roles: str) -> Phase:
    """A phase named `name` that needs the states of `roles` resident."""
    return Phase(name, frozenset(roles))


class Residency:
    """Which roles' states are on their devices; moves them as phases require and reports the bytes."""

    def __init__(
        self, clusters: dict[str, Cluster], devices: dict[str, list[int]], unmoved: frozenset[str] = frozenset()
    ) -> None:
        self.clusters = clusters
        self.devices = {name: set(devices.get(name, [])) for name in clusters}
        self.resident = set(clusters)
        self.unmoved = unmoved  # roles whose offload moves nothing: tracked, never called

    @classmethod
    def of_roles(cls, clusters: dict[str, Cluster], roles: dict[str, WorkerConfig]) -> Residency:
        """The residency of `clusters`, each on the devices its role's config maps it to; asks each role that can be
        offloaded whether its offload moves anything."""
        asked = {
            name: c.offload_moves_states(blocking=False)
            for name, c in clusters.items()
            if hasattr(c, "offload_moves_states")  # strategy workers: a reward function's worker holds no states
        }
        unmoved = frozenset(set(clusters) - {name for name, moves in asked.items() if any(moves.get())})
        return cls(clusters, {name: role.devices for name, role in roles.items()}, unmoved)

    def _shares_devices(self, role: str, others: frozenset[str]) -> bool:
        return any(self.devices[role] & self.devices[o] for o in others if o in self.devices and o != role)

    def enter(self, phase: Phase) -> dict[str, float]:
        """Offload colocated roles the phase does not need, load the ones it does; return metrics."""
        started = time.perf_counter()
        moved = 0.0
        needed = frozenset(r for r in phase.resident if r in self.clusters)
        leaving = [r for r in sorted(self.resident - needed) if self._shares_devices(r, needed)]
        arriving = sorted(needed - self.resident)
        # Every offload finishes before any load starts, so devices never hold both; within each
        # group the roles move at the same time.
        prefix = f"phase/{phase.name}"
        metrics: dict[str, float] = {}
        for roles, method in ((leaving, "offload_states"), (arriving, "load_states")):
            futures = {r: getattr(self.clusters[r], method)(blocking=False) for r in roles if r not in self.unmoved}
            for role, future in futures.items():
                reports = future.get()
                moved += sum(v for report in reports for k, v in report.items() if "/moved_bytes/" in k)
                # Rank 0's report stands for its role: per-kind bytes moved and bytes resident per place.
                metrics.update({f"{prefix}/{role}/{k}": v for k, v in reports[0].items()})
        self.resident = (self.resident - set(leaving)) | set(arriving)
        metrics[f"{prefix}/bytes_moved"] = moved
        metrics[f"{prefix}/residency_s"] = time.perf_counter() - started
        return metrics

    @contextmanager
    def timed(self, phase: Phase, metrics: dict[str, float]) -> Iterator[None]:
        """Enter `phase`, run the body, and record the residency moves and the body's seconds in `metrics`."""
        metrics.update(self.enter(phase))
        started = time.perf_counter()
        yield
        metrics[f"time/{phase.name}_s"] = time.perf_counter() - started
