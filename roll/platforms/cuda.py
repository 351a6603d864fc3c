"""CUDA platform, and ROCm and Ascend NPU as thin variants of it."""

from __future__ import annotations

from dataclasses import dataclass

from roll.platforms.platform import DtypeName, MemoryStats, Platform


@dataclass
class CudaPlatform(Platform):
    """NVIDIA GPUs: NCCL collectives, memory from torch's caching allocator."""

    name: str = "cuda"
    device_type: str = "cuda"
    dist_backend: str = "nccl"
    visible_devices_env: str = "CUDA_VISIBLE_DEVICES"
    ray_resource: str = "GPU"

    def _module(self):
        import torch

        return getattr(torch, self.device_type)

    def device_count(self) -> int:
        """Devices visible to this process."""
        return self._module().device_count()

    def memory_stats(self) -> MemoryStats:
        """Allocator statistics of the current device."""
        mod = self._module()
        return MemoryStats(
            allocated=mod.memory_allocated(), reserved=mod.memory_reserved(), peak=mod.max_memory_allocated()
        )

    def empty_cache(self) -> None:
        """Release the caching allocator's unused blocks."""
        self._module().empty_cache()

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its local device."""
        self._module().set_device(local_rank)

    def dtype_unsupported_reason(self, dtype: DtypeName) -> str:
        """bf16 as torch (and DeepSpeed) judge the current device; fp16 and fp32 run on every GPU.

        A process that sees no device (a driver on a CPU-only head node) cannot tell and answers "".
        """
        import torch

        mod = getattr(torch, self.device_type, None)
        if dtype != "bf16" or mod is None or not mod.is_available() or not hasattr(mod, "is_bf16_supported"):
            return ""
        if mod.is_bf16_supported():
            return ""
        return f"{mod.get_device_name()} has no bf16 support"


@dataclass
class RocmPlatform(CudaPlatform):
    """AMD GPUs: torch exposes them as `cuda`; RCCL answers to the `nccl` backend name."""

    name: str = "rocm"
    visible_devices_env: str = "HIP_VISIBLE_DEVICES"


@dataclass
class NpuPlatform(CudaPlatform):
    """Huawei Ascend NPUs through torch_npu: HCCL collectives."""

    name: str = "npu"
    device_type: str = "npu"
    dist_backend: str = "hccl"
    visible_devices_env: str = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource: str = "NPU"
