"""The entry scripts as a user runs them, in a process of their own (costlier than the unit tests)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("start_rlvr_pipeline.py", ["pretrain=tiny://qwen2"]),
        ("start_sft_pipeline.py", []),
        ("start_cluster_check.py", []),
    ],
)
def test_every_entry_point_takes_dry_run(script: str, overrides: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, f"examples/{script}", "dry_run=true", *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "nothing was started" in result.stdout and "== placement" in result.stdout
    assert "Started a local Ray instance" not in result.stderr
