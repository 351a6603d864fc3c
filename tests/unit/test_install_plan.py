"""scripts/setup_env.sh installs the right torch build on machines whose pip knows no local wheels.

Each test runs the script's install plan (`ROLL_INSTALL_PLAN=1`) under a clean pip configuration whose indexes are
local file indexes built here in place of PyPI and PyTorch's own, then resolves the plan's torch step with pip's own
resolver (`--dry-run --report`) and checks where the wheel would come from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

TORCH_VERSION = next(
    line.removeprefix("torch==")
    for line in (REPO_ROOT / "requirements_torch.txt").read_text().splitlines()
    if line.startswith("torch==")
)


def _wheel(directory: Path, version: str) -> Path:
    """An empty installable wheel of `torch` at `version`."""
    directory.mkdir(parents=True, exist_ok=True)
    info = f"torch-{version}.dist-info"
    path = directory / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("torch/__init__.py", "")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        tags = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        wheel.writestr(f"{info}/WHEEL", tags)
        wheel.writestr(f"{info}/RECORD", "")
    return path


def _index(root: Path, *versions: str) -> str:
    """A PEP 503 simple index at `root` holding torch wheels of `versions`; its file:// URL."""
    project = root / "torch"
    links = "".join(f'<a href="{_wheel(project, v).name}">{_wheel(project, v).name}</a>\n' for v in versions)
    (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return root.as_uri()


@pytest.fixture
def clean_pip(tmp_path: Path) -> dict[str, str]:
    """An environment whose pip reads no configuration file and whose only index is a local stand-in for PyPI,
    which holds the plain (CUDA) torch build only, as PyPI does for Linux."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": _index(tmp_path / "pypi", TORCH_VERSION),
        "ROLL_PYTHON": sys.executable,
        "ROLL_VENV": str(Path(sys.prefix)),
    }


def _plan(env: dict[str, str]) -> list[str]:
    result = subprocess.run(
        ["bash", "scripts/setup_env.sh"],
        cwd=REPO_ROOT,
        env=env | {"ROLL_INSTALL_PLAN": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def _resolved_torch(step: str, env: dict[str, str], tmp_path: Path) -> tuple[str, str]:
    """The version and source URL pip's resolver picks for the plan's torch `step`."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "-q"]
    subprocess.run([*command, "--report", str(report), *step.split()], env=env, check=True, timeout=120)
    (install,) = json.loads(report.read_text())["install"]
    return install["metadata"]["version"], install["download_info"]["url"]


@pytest.mark.parametrize(("device", "build"), [("cpu", "cpu"), ("cuda", "cu128")])
def test_without_local_wheels_torch_comes_from_its_builds_own_index(
    clean_pip: dict[str, str], tmp_path: Path, device: str, build: str
) -> None:
    builds_index = _index(tmp_path / build, f"{TORCH_VERSION}+{build}")
    env = clean_pip | {"ROLL_DEVICE": device, "ROLL_TORCH_INDEX": builds_index}
    plan = _plan(env)
    (torch_step,) = [step for step in plan if "torch==" in step]
    version, url = _resolved_torch(torch_step, env, tmp_path)
    assert version == f"{TORCH_VERSION}+{build}"
    assert url.startswith(builds_index), url
    requirement_steps = [step for step in plan if "requirements_common.txt" in step]
    assert len(requirement_steps) == 1
    device_file, other_file = ("requirements_cpu.txt", "requirements_gpu.txt")[:: 1 if device == "cpu" else -1]
    assert device_file in requirement_steps[0] and other_file not in " ".join(plan)
    assert plan[-1] == "--no-build-isolation --no-deps -e ."  # roll last, editable, adding no requirement of its own


def test_a_local_wheel_directory_is_used_without_any_other_index(clean_pip: dict[str, str], tmp_path: Path) -> None:
    local = tmp_path / "wheels"
    _wheel(local, f"{TORCH_VERSION}+cpu")
    env = clean_pip | {"ROLL_DEVICE": "cpu", "PIP_FIND_LINKS": str(local), "ROLL_TORCH_INDEX": "file:///nonexistent"}
    (torch_step,) = [step for step in _plan(env) if "torch==" in step]
    assert "--extra-index-url" not in torch_step
    version, url = _resolved_torch(torch_step, env, tmp_path)
    assert version == f"{TORCH_VERSION}+cpu" and url.startswith(local.as_uri())


def test_an_unknown_device_is_refused_naming_the_choices() -> None:
    result = subprocess.run(
        ["bash", "scripts/setup_env.sh"],
        cwd=REPO_ROOT,
        env=os.environ | {"ROLL_DEVICE": "tpu", "ROLL_INSTALL_PLAN": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "ROLL_DEVICE=tpu is not one of: cpu, cuda" in result.stderr
