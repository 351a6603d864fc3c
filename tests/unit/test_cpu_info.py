"""DeepSpeed's CPU probe runs once per machine boot: later calls and later processes read the stored answer."""

from __future__ import annotations

import json
from pathlib import Path

import cpuinfo
import pytest

from roll.third_party.deepspeed import cpu_info

PROBE = {"arch": "X86_64", "vendor_id_raw": "AuthenticAMD", "flags": ["avx2", "sse2"]}


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """py-cpuinfo's probe replaced by one that counts its calls; roll's cache in `tmp_path`."""
    calls: list[int] = []

    def probe() -> dict:
        calls.append(1)
        return dict(PROBE)

    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
    monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path))
    return calls


def in_a_new_process(monkeypatch: pytest.MonkeyPatch, probes: list[int]) -> None:
    """What a new process starts with: py-cpuinfo's own function (here the counting probe), not yet wrapped."""

    def probe() -> dict:
        probes.append(1)
        return dict(PROBE)

    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
    cpu_info.reuse_cpu_info()


def stored(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cpuinfo").glob("*.json"))


def test_one_probe_serves_every_call_and_every_later_process(
    probes: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cpu_info.reuse_cpu_info()
    cpu_info.reuse_cpu_info()  # a second call wraps nothing twice
    assert cpuinfo.get_cpu_info() == PROBE and cpuinfo.get_cpu_info() == PROBE
    assert len(probes) == 1
    [path] = stored(tmp_path)
    assert path.name.startswith(cpu_info.BOOT_ID.read_text().strip())
    assert json.loads(path.read_text()) == PROBE
    in_a_new_process(monkeypatch, probes)
    assert cpuinfo.get_cpu_info() == PROBE
    assert len(probes) == 1  # read from the cache, not probed


def test_a_damaged_entry_is_probed_again_and_replaced(
    probes: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cpu_info.reuse_cpu_info()
    cpuinfo.get_cpu_info()
    [path] = stored(tmp_path)
    path.write_text('{"arch": "X86')  # cut short
    in_a_new_process(monkeypatch, probes)
    assert cpuinfo.get_cpu_info() == PROBE
    assert len(probes) == 2
    assert json.loads(path.read_text()) == PROBE
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staged file left beside it


def test_a_failed_probe_is_not_stored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpuinfo, "get_cpu_info", dict)  # py-cpuinfo's answer when its probe process fails: {}
    monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path))
    cpu_info.reuse_cpu_info()
    assert cpuinfo.get_cpu_info() == {}
    assert stored(tmp_path) == []


def test_an_unwritable_cache_still_answers(probes: list[int], tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text("a file where the folder would go")
    cpu_info.reuse_cpu_info()
    assert cpuinfo.get_cpu_info() == PROBE
    assert len(probes) == 1
