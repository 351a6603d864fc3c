"""CPU platform: a device is a slot of cores, collectives go over gloo."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from roll.platforms.platform import MemoryStats, Platform, host_rss_bytes


@dataclass
class CpuPlatform(Platform):
    """Host memory stands in for device memory; `peak` is the process's maximum RSS."""

    name: str = "cpu"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    ray_resource: str = "CPU"

    def device_name(self, local_rank: int) -> str:
        """All ranks on a node share the one `cpu` device."""
        return "cpu"

    def device_count(self) -> int:
        """Cores this process may run on."""
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def memory_stats(self) -> MemoryStats:
        """Process RSS as both allocated and reserved memory."""
        rss = host_rss_bytes()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return MemoryStats(allocated=rss, reserved=rss, peak=max(peak, rss))

    def empty_cache(self) -> None:
        """Nothing to release: the host allocator returns memory on its own."""
