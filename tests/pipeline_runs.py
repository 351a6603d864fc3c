"""Running a pipeline in the test process or an entry point in its own, and reading the metrics a run logged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO_ROOT


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


def config_error_of(script: str, *args: str) -> str:
    """The message of the one `config error:` line of `python <script> <args>`, which must exit with code 2 before
    Ray starts and without a traceback."""
    result = subprocess.run([sys.executable, script, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("config error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Started a local Ray" not in result.stderr, result.stderr[-2000:]
    return errors[0].removeprefix("config error: ")
