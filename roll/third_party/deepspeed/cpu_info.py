"""One CPU probe per machine boot for DeepSpeed's CPU ops, instead of three per training process.

DeepSpeed asks py-cpuinfo about the CPU each time it loads a CPU op (the compile flags' `-march` and SIMD width)
and again when it builds `DeepSpeedCPUAdam` (the vendor). Each `cpuinfo.get_cpu_info()` starts a Python process that
probes the CPU for about a second of CPU time, so every training worker spent about 3 CPU-seconds on the same
answer. The answer cannot change until the machine reboots, so it is kept in roll's cache directory under the
kernel's boot id and read by every later process of that boot.
"""

from __future__ import annotations

import functools
from pathlib import Path

from roll.utils.fileio import cache_root, read_or_compute_json

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def reuse_cpu_info(cache_dir: str | None = None) -> None:
    """Make `cpuinfo.get_cpu_info` return this boot's cached probe (probing once, then writing it) in this process.
    Does nothing where the boot id is unknown (not Linux) or py-cpuinfo is not installed."""
    try:
        import cpuinfo
    except ImportError:
        return
    if not BOOT_ID.exists() or getattr(cpuinfo.get_cpu_info, "roll_cached", False):
        return
    version = ".".join(map(str, cpuinfo.CPUINFO_VERSION))
    path = cache_root(cache_dir) / "cpuinfo" / f"{BOOT_ID.read_text().strip()}-{version}.json"
    # py-cpuinfo answers {} when its probe process failed: not kept, so the next process probes again
    cached = functools.cache(functools.partial(read_or_compute_json, path, cpuinfo.get_cpu_info))
    cached.roll_cached = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = cached
