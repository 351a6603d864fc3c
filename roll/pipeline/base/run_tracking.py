"""The metrics tracker of a pipeline run, opened fresh or continuing a resumed run's history."""

from __future__ import annotations

import dataclasses

from roll.pipeline.base.pipeline_config import PipelineConfig
from roll.utils.tracking import MetricsTracker


def open_run_tracker(config: PipelineConfig, resumed_step: int = 0) -> MetricsTracker:
    """The tracker writing under `<run_dir>/logs`; a run resumed at `resumed_step` keeps the history up to it."""
    tracker = MetricsTracker(
        f"{config.run_dir}/logs",
        resume_history=resumed_step > 0,
        trackers=config.trackers,
        run_name=config.exp_name,
        config=dataclasses.asdict(config),
    )
    if resumed_step:
        tracker.truncate(resumed_step)
    return tracker
