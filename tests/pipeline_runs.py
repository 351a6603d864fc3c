"""Running a pipeline or an entry point in the test process (or an entry point in its own), and reading the metrics a
run logged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO_ROOT
from tests.in_process import run_in_process


def logged_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of `<run_dir>/logs/metrics.jsonl`, one per logged step."""
    lines = (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def run_pipeline(pipeline_cls: type, config: Any) -> tuple[Any, list[dict]]:
    """Run `pipeline_cls(config)` to the end, always shut it down; its result and its logged metrics."""
    pipeline = pipeline_cls(config)
    try:
        result = pipeline.run()
    finally:
        pipeline.shutdown()
    return result, logged_metrics(config.run_dir)


def config_error_of(script: str, *args: str, own_process: bool = False) -> str:
    """The message of the one `config error:` line of `python <script> <args>`, which must exit with code 2 before
    Ray starts and without a traceback.

    The script runs in this process (tests/in_process.py, where starting Ray fails the command), or with
    `own_process` as a user runs it, in a Python process of its own.
    """
    if own_process:
        ran = subprocess.run(
            [sys.executable, script, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
        )
        returncode, stderr = ran.returncode, ran.stderr
    else:
        outcome = run_in_process(["python", script, *args], REPO_ROOT)
        returncode, stderr = outcome.returncode, outcome.stderr
    assert returncode == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("config error: ")]
    assert len(errors) == 1, stderr[-2000:]
    assert "Traceback" not in stderr and "Started a local Ray" not in stderr, stderr[-2000:]
    return errors[0].removeprefix("config error: ")
