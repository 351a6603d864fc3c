"""The platform layer: names, backends and visible-device variables per device family."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from roll.platforms import current_platform, get_platform
from roll.platforms.cpu import cpu_model_name


@pytest.mark.parametrize(
    ("name", "device_type", "backend", "env", "resource"),
    [
        ("cpu", "cpu", "gloo", "", "CPU"),
        ("cuda", "cuda", "nccl", "CUDA_VISIBLE_DEVICES", "GPU"),
        ("rocm", "cuda", "nccl", "HIP_VISIBLE_DEVICES", "GPU"),
        ("npu", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU"),
    ],
)
def test_platform_facts(name: str, device_type: str, backend: str, env: str, resource: str) -> None:
    platform = get_platform(name)
    assert (platform.device_type, platform.dist_backend, platform.visible_devices_env) == (
        device_type,
        backend,
        env,
    )
    assert platform.ray_resource == resource
    assert platform.is_accelerator == (name != "cpu")


def test_visible_devices_environment() -> None:
    assert get_platform("cuda").visible_devices_environ([2, 3]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert get_platform("rocm").visible_devices_environ([1]) == {"HIP_VISIBLE_DEVICES": "1"}
    assert get_platform("cpu").visible_devices_environ([0]) == {}


def test_device_names() -> None:
    assert get_platform("cuda").device_name(1) == "cuda:1"
    assert get_platform("cpu").device_name(1) == "cpu"


def test_cpu_memory_stats_are_real() -> None:
    stats = get_platform("cpu").memory_stats()
    assert 0 < stats.allocated <= stats.peak
    # New pages of the process's own, each written: memory from the allocator may reuse pages freed earlier that
    # still count in the RSS (it happened in the suite's test process).
    held = mmap.mmap(-1, 64 * 1024 * 1024)
    for offset in range(0, len(held), mmap.PAGESIZE):
        held[offset] = 1
    assert get_platform("cpu").memory_stats().allocated >= stats.allocated + len(held) // 2


def test_unknown_platform_lists_valid() -> None:
    with pytest.raises(ValueError, match="valid platforms: cpu, cuda, rocm, npu"):
        get_platform("tpu")


def test_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    current_platform.cache_clear()
    monkeypatch.setenv("ROLL_PLATFORM", "cpu")
    try:
        assert current_platform().name == "cpu"
    finally:
        current_platform.cache_clear()


def test_cpu_fp16_support_is_what_onednn_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = get_platform("cpu")
    monkeypatch.setattr("roll.platforms.cpu.onednn_supports_fp16", lambda: False)
    assert not cpu.supports_dtype("fp16")
    assert "oneDNN finds no fp16 support" in cpu.dtype_unsupported_reason("fp16")
    assert cpu.supports_dtype("bf16") and cpu.supports_dtype("fp32")
    monkeypatch.setattr("roll.platforms.cpu.onednn_supports_fp16", lambda: True)
    assert cpu.supports_dtype("fp16") and cpu.dtype_unsupported_reason("fp16") == ""


def test_cpu_fp16_detection_agrees_with_deepspeed() -> None:
    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from roll.platforms.cpu import onednn_supports_fp16

    assert onednn_supports_fp16() == bool(CPU_Accelerator().is_fp16_supported())
    assert get_platform("cpu").supports_dtype("fp16") == (torch.float16 in CPU_Accelerator().supported_dtypes())


def test_cuda_answers_for_its_gpus_not_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr("roll.platforms.cpu.onednn_supports_fp16", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla V100")
    cuda = get_platform("cuda")
    assert cuda.supports_dtype("fp16") and cuda.supports_dtype("fp32")
    assert cuda.dtype_unsupported_reason("bf16") == "Tesla V100 has no bf16 support"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda.supports_dtype("bf16")  # a driver without GPUs cannot tell, so it does not refuse


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx2", "fma"}, "fp32"),  # AVX2 only: torch emulates bf16 products
        ({"avx512f", "avx512_bf16"}, "bf16"),
        ({"amx_tile", "amx_bf16"}, "bf16"),
        ({"asimd", "bf16"}, "bf16"),  # Arm's BF16 extension
        (set(), "fp32"),  # /proc/cpuinfo unreadable
    ],
)
def test_cpu_auto_dtype_is_bf16_only_with_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], expected: str
) -> None:
    from roll.platforms import resolve_dtype

    monkeypatch.setattr("roll.platforms.cpu.cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr("roll.platforms.current_platform", lambda: get_platform("cpu"))
    assert get_platform("cpu").preferred_dtype() == expected
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("fp16") == "fp16"  # a named precision is kept as it is


def test_cuda_auto_dtype_is_bf16_where_the_gpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert get_platform("cuda").preferred_dtype() == "fp32"  # never fp16: its loss scaling changes training
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert get_platform("cuda").preferred_dtype() == "bf16"


def test_cpu_model_name_keeps_the_family_and_model_a_vm_leaves(tmp_path: Path) -> None:
    """Two machines both named "AMD EPYC" here differed twofold in speed: benchmark rows name the family too."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n"
        "processor\t: 1\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: other\n"
    )
    assert cpu_model_name(str(cpuinfo)) == "AMD EPYC (family 25, model 17)"
    plain = tmp_path / "cpuinfo-without-family"  # another path: the answer is cached per path
    plain.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert cpu_model_name(str(plain)) == "Some CPU"
    assert cpu_model_name(str(tmp_path / "missing")) == os.uname().machine
