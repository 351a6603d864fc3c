"""The device platform interface: everything that differs between CPU, CUDA, ROCm and Ascend NPU."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

# The precisions a role's `model_args.dtype` names (besides "auto", which the platform turns into one of them).
DtypeName = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class MemoryStats:
    """Bytes of device memory: currently allocated, reserved by the caching allocator, and the peak."""

    allocated: int
    reserved: int
    peak: int


@dataclass
class Platform(ABC):
    """A device family. Subclasses fill the class attributes and the memory hooks.

    `device_type` is the torch device type, `dist_backend` the torch.distributed backend for
    collectives, `visible_devices_env` the variable that restricts a process to some devices
    (empty on CPU, where a device is a slot of cores) and `ray_resource` the Ray resource that
    counts one device ("CPU" on CPU nodes, where a device is `cpus_per_device` cores).
    """

    # Each platform redeclares these fields with its own values, so the platform dataclasses look alike
    # by design (the duplicates tool pairs them).
    name: str = ""
    device_type: str = ""
    dist_backend: str = ""
    visible_devices_env: str = ""
    ray_resource: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def is_accelerator(self) -> bool:
        """Whether a device is a real accelerator rather than a slot of CPU cores."""
        return self.device_type != "cpu"

    def device_name(self, local_rank: int) -> str:
        """The torch device string for a process's local rank, e.g. `cuda:0` or `cpu`."""
        return f"{self.device_type}:{local_rank}"

    def visible_devices_environ(self, local_device_ids: list[int]) -> dict[str, str]:
        """Environment variables that restrict a worker to the given node-local device indices."""
        env = dict(self.extra_env)
        if self.visible_devices_env:
            env[self.visible_devices_env] = ",".join(str(i) for i in local_device_ids)
        return env

    @abstractmethod
    def device_count(self) -> int:
        """How many devices of this platform this process can see."""

    @abstractmethod
    def memory_stats(self) -> MemoryStats:
        """Memory of the current device, in bytes."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused device memory to the system."""

    def set_device(self, local_rank: int) -> None:
        """Make `local_rank` the current device of this process (a no-op on CPU)."""

    def supports_dtype(self, dtype: DtypeName) -> bool:
        """Whether this machine's devices compute in `dtype` for training and inference."""
        return not self.dtype_unsupported_reason(dtype)

    def preferred_dtype(self) -> DtypeName:
        """What `model_args.dtype: auto` becomes: bf16 where the devices compute it, else fp32 (never fp16, whose
        loss scaling changes training)."""
        return "bf16" if self.supports_dtype("bf16") else "fp32"

    @abstractmethod
    def dtype_unsupported_reason(self, dtype: DtypeName) -> str:
        """Why this machine's devices cannot compute in `dtype`, for an error message; "" when they can."""


def host_rss_bytes() -> int:
    """Resident set size of this process, read from /proc (0 where /proc is missing)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
