"""The platform layer: names, backends and visible-device variables per device family."""

from __future__ import annotations

import pytest

from roll.platforms import current_platform, get_platform


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
    held = bytearray(64 * 1024 * 1024)
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
