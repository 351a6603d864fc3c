"""Platform detection: `current_platform()` answers which devices this process runs on."""

from __future__ import annotations

import functools
import os

from roll.platforms.cpu import CpuPlatform
from roll.platforms.cuda import CudaPlatform, NpuPlatform, RocmPlatform
from roll.platforms.platform import DtypeName, MemoryStats, Platform

PLATFORMS: dict[str, type[Platform]] = {
    "cpu": CpuPlatform,
    "cuda": CudaPlatform,
    "rocm": RocmPlatform,
    "npu": NpuPlatform,
}

PLATFORM_ENV = "ROLL_PLATFORM"


def get_platform(name: str) -> Platform:
    """The platform called `name`; a `ValueError` lists the valid names."""
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; valid platforms: {', '.join(PLATFORMS)}")
    return PLATFORMS[name]()


def detect_platform() -> Platform:
    """Pick the platform from the hardware torch sees: NPU, ROCm, CUDA, else CPU."""
    import torch

    if hasattr(torch, "npu") and torch.npu.is_available():
        return NpuPlatform()
    if torch.cuda.is_available():
        return RocmPlatform() if torch.version.hip else CudaPlatform()
    return CpuPlatform()


@functools.cache
def current_platform() -> Platform:
    """The platform named by `ROLL_PLATFORM` (set from the config's `platform`), else detected."""
    name = os.environ.get(PLATFORM_ENV, "")
    return get_platform(name) if name else detect_platform()


def resolve_dtype(name: str) -> DtypeName:
    """A `model_args.dtype`, with "auto" replaced by the precision this run's platform computes fastest."""
    return current_platform().preferred_dtype() if name == "auto" else name  # type: ignore[return-value]


__all__ = [
    "PLATFORMS",
    "PLATFORM_ENV",
    "MemoryStats",
    "Platform",
    "current_platform",
    "get_platform",
    "resolve_dtype",
]
