"""Held-out accuracy curves of several seeds, and the time each side of a comparison needs to reach a target.

Used by `benchmarks/compare_trl.py --to-accuracy`. A point is one evaluation: the RL step, the held-out accuracy,
the wall seconds since the command started and the seconds spent in training steps, both without evaluation time.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    """One evaluation of a run: held-out accuracy after `step` RL steps, and the seconds it took to get there."""

    step: int
    accuracy: float
    wall_s: float
    train_s: float


def save_points(points: Sequence[Point], path: Path) -> None:
    """Write `points` as JSON (the TRL child's result)."""
    path.write_text(json.dumps([asdict(p) for p in points]))


def load_points(path: Path) -> list[Point]:
    """The points `save_points` wrote."""
    return [Point(**p) for p in json.loads(path.read_text())]


def roll_points(metrics: Sequence[dict[str, float]]) -> list[Point]:
    """The evaluations of a roll run from its metrics.jsonl rows.

    An evaluation row carries `time/eval_s` and `time/elapsed_s` (wall since the command, evaluations included);
    a step that evaluates also counts the evaluation in its `time/step_s`.
    """
    points, evals_s, train_s = [], 0.0, 0.0
    for row in sorted(metrics, key=lambda r: r["step"]):
        eval_s = row.get("time/eval_s", 0.0)
        if row["step"] > 0:
            train_s += row["time/step_s"] - eval_s
        evals_s += eval_s
        if "val/accuracy" in row:
            wall_s = row["time/elapsed_s"] - evals_s
            points.append(Point(int(row["step"]), row["val/accuracy"], wall_s, train_s))
    return points


def trailing_means(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value with up to `window - 1` values before it."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def mean_curve(curves: Sequence[Sequence[Point]]) -> list[Point]:
    """The seeds' mean at each step every curve evaluated."""
    steps = sorted(set.intersection(*(set(p.step for p in curve) for curve in curves)))
    by_step = [{p.step: p for p in curve} for curve in curves]
    return [
        Point(
            step,
            statistics.fmean(c[step].accuracy for c in by_step),
            statistics.fmean(c[step].wall_s for c in by_step),
            statistics.fmean(c[step].train_s for c in by_step),
        )
        for step in steps
    ]


def final_accuracy(curve: Sequence[Point], window: int) -> float:
    """The mean of a curve's last `window` evaluations."""
    return statistics.fmean(p.accuracy for p in curve[-window:])


def first_reaching(curves: Sequence[Sequence[Point]], target: float, window: int) -> Point | None:
    """The first point of the seeds' mean curve whose trailing mean over `window` evaluations reaches `target`."""
    mean = mean_curve(curves)
    smoothed = trailing_means([p.accuracy for p in mean], window)
    return next((p for p, s in zip(mean, smoothed, strict=True) if s >= target - 1e-9), None)


def standard_error(accuracy: float, examples: int) -> float:
    """The binomial standard error of one evaluation's accuracy on `examples` held-out problems."""
    return math.sqrt(accuracy * (1 - accuracy) / examples)
