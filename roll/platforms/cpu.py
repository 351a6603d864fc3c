"""CPU platform: a device is a slot of cores, collectives go over gloo."""

from __future__ import annotations

import functools
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from roll.platforms.platform import DtypeName, MemoryStats, Platform, host_rss_bytes


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

    def dtype_unsupported_reason(self, dtype: DtypeName) -> str:
        """fp16 needs oneDNN fp16 kernels (DeepSpeed refuses it without them); bf16 and fp32 run on any CPU."""
        if dtype != "fp16" or onednn_supports_fp16():
            return ""
        x86_hint = "; x86 needs AVX512-FP16 or AMX-FP16" if os.uname().machine in ("x86_64", "i686") else ""
        return f"{cpu_model_name()}: oneDNN finds no fp16 support{x86_hint}"

    def preferred_dtype(self) -> DtypeName:
        """bf16 only on CPUs with bf16 instructions: elsewhere torch emulates bf16 products, which
        `benchmarks/precision.py` measured 40x slower than fp32 on an AVX2 CPU."""
        return "bf16" if NATIVE_BF16_FLAGS & cpu_flags() else "fp32"


# The CPU feature flags of bf16 arithmetic in hardware: x86's AMX and AVX512-BF16, Arm's BF16 extension.
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})


def cpuinfo_fields(cpuinfo: str) -> dict[str, str]:
    """Each key of /proc/cpuinfo text with its first value: the first processor's."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def parse_cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in /proc/cpuinfo text (`flags` on x86, `Features` on Arm)."""
    fields = cpuinfo_fields(cpuinfo)
    return set(fields.get("flags", fields.get("Features", "")).split())


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (empty when /proc/cpuinfo cannot be read)."""
    try:
        return frozenset(parse_cpu_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return frozenset()


@functools.cache
def onednn_supports_fp16() -> bool:
    """Whether oneDNN has fp16 kernels for this CPU: the check DeepSpeed's CPU accelerator makes."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # torch built without oneDNN
        return False


@functools.cache
def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from `cpuinfo` with its family and model numbers (VMs may show only "AMD EPYC", and
    machines so named here differ twofold in speed), else the machine architecture."""
    try:
        fields = cpuinfo_fields(Path(cpuinfo).read_text())
    except OSError:
        fields = {}
    name = fields.get("model name")
    if not name:
        return os.uname().machine
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name
