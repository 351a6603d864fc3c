"""Running a pipeline in the test process, and reading the metrics a run logged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
