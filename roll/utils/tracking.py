"""Tracking a run: its metrics (`MetricsTracker`: TensorBoard events, a JSONL history, PNG plots of the main
curves, the external trackers of `roll.utils.external_trackers`), timed evaluations, and progress output."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TextIO, TypeVar

import psutil

from roll.utils.console import MILESTONE
from roll.utils.external_trackers import open_trackers

T = TypeVar("T")

PLOTTED = {
    "reward": "rollout/score_mean",
    "accuracy": "val/accuracy",
    "kl": "actor/kl",
    "response_length": "rollout/response_length_mean",
    "preference_accuracy": "val/preference_accuracy",
    "reward_margin": "actor/rewards/margin",
    "distillation_kl": "student/kl",
    "step_accuracy": "val/step_accuracy",
}

logger = logging.getLogger(__name__)


class MetricsTracker:
    """Writes every logged step to TensorBoard, `metrics.jsonl` under `log_dir` and the external `trackers`.

    The external trackers (wandb, swanlab, mlflow) also get the run's `config` and the sample tables;
    `close` writes the plots.
    """

    def __init__(
        self,
        log_dir: str,
        resume_history: bool = False,
        trackers: Sequence[str] = (),
        run_name: str = "",
        config: dict[str, Any] | None = None,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.history_file = self.log_dir / "metrics.jsonl"
        self.history: list[dict[str, float]] = []
        if resume_history and self.history_file.is_file():
            self.history = [json.loads(line) for line in self.history_file.read_text().splitlines() if line]
        elif self.history_file.exists():
            self.history_file.unlink()
        self.writer = SummaryWriter(str(self.log_dir / "tensorboard"))
        self.external = open_trackers(trackers, self.log_dir, run_name or self.log_dir.parent.name, config or {})

    @classmethod
    def for_run(cls, config: Any, resumed_step: int = 0) -> MetricsTracker:
        """The tracker of a pipeline run (its config dataclass: `run_dir`, `trackers`, `exp_name`), writing under
        `<run_dir>/logs`; a run resumed at `resumed_step` keeps the history up to it."""
        tracker = cls(
            f"{config.run_dir}/logs",
            resume_history=resumed_step > 0,
            trackers=config.trackers,
            run_name=config.exp_name,
            config=dataclasses.asdict(config),
        )
        if resumed_step:
            tracker.truncate(resumed_step)
        return tracker

    def truncate(self, step: int) -> None:
        """Forget steps after `step` (a resumed run recomputes them)."""
        self.history = [row for row in self.history if row["step"] <= step]
        self.history_file.write_text("".join(json.dumps(row) + "\n" for row in self.history))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record `metrics` at `step`."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(row)
        with self.history_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        finite = {key: float(value) for key, value in metrics.items() if math.isfinite(value)}
        for key, value in finite.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        for tracker in self.external:
            tracker.log(finite, step)

    def log_samples(self, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Record generated samples at `step`: `samples.jsonl` under `log_dir` and a table in each external tracker."""
        with (self.log_dir / "samples.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **dict(zip(columns, row, strict=True))}) + "\n")
        for tracker in self.external:
            tracker.log_table("samples", columns, rows, step)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of one metric across the history."""
        points = [(int(row["step"]), row[key]) for row in self.history if key in row]
        return [s for s, _ in points], [v for _, v in points]

    def plot(self) -> list[Path]:
        """One PNG per plotted curve that has data; return their paths."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        paths = []
        for name, key in PLOTTED.items():
            steps, values = self.series(key)
            if not steps:
                continue
            figure, axis = plt.subplots(figsize=(5, 3.2))
            axis.plot(steps, values, marker="o" if len(steps) < 30 else None)
            axis.set_xlabel("step")
            axis.set_ylabel(key)
            axis.set_title(name.replace("_", " "))
            axis.grid(alpha=0.3)
            figure.tight_layout()
            path = self.log_dir / f"{name}.png"
            figure.savefig(path, dpi=100)
            plt.close(figure)
            paths.append(path)
        return paths

    def close(self) -> list[Path]:
        """Flush TensorBoard, end the external trackers' runs and write the plots."""
        self.writer.close()
        for tracker in self.external:
            tracker.close()
        return self.plot()


class Progress(Protocol[T]):
    """What a pipeline loop needs of its progress display: iteration and a postfix of current values."""

    def __iter__(self) -> Iterator[T]: ...

    def set_postfix(self, **values: object) -> None: ...


class LogLines(Generic[T]):
    """Progress for a log file or pipe: one short line at most every `interval_s` seconds, and one at the end."""

    def __init__(self, iterable: Iterable[T], desc: str, stream: TextIO, interval_s: float) -> None:
        self.iterable = iterable
        self.desc = desc
        self.stream = stream
        self.interval_s = interval_s
        self.total = len(iterable) if hasattr(iterable, "__len__") else None
        self.postfix: dict[str, object] = {}

    def set_postfix(self, **values: object) -> None:
        """Values shown at the end of the next line."""
        self.postfix = values

    def __iter__(self) -> Iterator[T]:
        started = last = time.monotonic()
        done, written = 0, None
        for item in self.iterable:
            yield item
            done += 1
            now = time.monotonic()
            if now - last >= self.interval_s:
                self._write(done, now - started)
                last, written = now, done
        if written != done:
            self._write(done, time.monotonic() - started)

    def _write(self, done: int, elapsed_s: float) -> None:
        count = f"{done}/{self.total}" if self.total is not None else str(done)
        per_step = f", {elapsed_s / done:.2f} s/step" if done else ""
        values = "".join(f", {key}={value}" for key, value in self.postfix.items())
        self.stream.write(f"{self.desc}: {count} in {elapsed_s:.0f} s{per_step}{values}\n")
        self.stream.flush()


def show_progress(
    iterable: Iterable[T], desc: str, stream: TextIO | None = None, interval_s: float = 30.0
) -> Progress[T]:
    """A tqdm bar on a terminal; on a file or pipe, a `LogLines` line every `interval_s` seconds instead.

    tqdm rewrites its bar with carriage returns on every postfix update, which a log file keeps:
    one line of kilobytes per run.
    """
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, file=stream, dynamic_ncols=True)
    return LogLines(iterable, desc, stream, interval_s)


def timed_evaluation(evaluate: Callable[[], dict[str, float]], step: int) -> dict[str, float]:
    """`evaluate()`'s metrics plus `time/eval_s` (its seconds) and `time/elapsed_s` (wall seconds since this process
    started, the user's command, evaluations included): what time-to-accuracy comparisons read. The held-out
    results are a milestone of the console at `step`."""
    started = time.perf_counter()
    metrics = dict(evaluate())
    metrics["time/eval_s"] = time.perf_counter() - started
    metrics["time/elapsed_s"] = time.time() - psutil.Process().create_time()
    held_out = ", ".join(
        f"{name.removeprefix('val/')} {value:.3g}" for name, value in metrics.items() if name.startswith("val/")
    )
    logger.info("evaluation at step %d: %s", step, held_out or "no held-out metrics", extra=MILESTONE)
    return metrics
