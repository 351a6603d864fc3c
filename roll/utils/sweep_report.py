"""`roll-sweep-report SWEEP_DIR`: the jobs of a Hydra multirun side by side, from their `metrics.jsonl`.

SWEEP_DIR may also be a run's folder (`output/rlvr`): its latest sweep is reported.

Each job folder of a sweep (`<run>/sweep-<time>/<n>/`, as `roll-rlvr -m ...` writes them) holds Hydra's
record of its overrides (`.hydra/overrides.yaml`) and its metrics (`logs/metrics.jsonl`). The report names
each job by the overrides that differ between jobs, and gives every metric's final and best value
(the highest, or the lowest for losses). Jobs that differ only in `seed` form a group, shown as the mean
and the spread (sample standard deviation) over its seeds. It writes `sweep_report.md` (the tables) and
one plot per metric (`sweep_<metric>.png`: every job's curve, coloured by group) into the sweep folder.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

SEED = "seed"
DEFAULT_PREFIXES = ("val/",)


@dataclass(frozen=True)
class Job:
    """One job of the sweep: its folder, its overrides and its logged rows."""

    path: Path
    overrides: dict[str, str]
    rows: list[dict[str, float]]

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """Steps and finite values of `metric`."""
        points = [(int(r["step"]), float(r[metric])) for r in self.rows if _finite(r.get(metric))]
        return [s for s, _ in points], [v for _, v in points]


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def lower_is_better(metric: str) -> bool:
    """Whether the best value of `metric` is its lowest (losses, errors, time)."""
    return "loss" in metric or "error" in metric or metric.endswith("_s") or metric.startswith("time/")


def sweep_folder(path: Path) -> Path:
    """`path` itself when it holds job folders, else its latest `sweep-<time>` folder (a run's folder was given)."""
    if any(path.glob("*/logs/metrics.jsonl")):
        return path
    sweeps = sorted(p for p in path.glob("sweep-*") if p.is_dir())
    return sweeps[-1] if sweeps else path


def read_jobs(sweep_dir: Path) -> list[Job]:
    """The sweep's jobs, in job-number order; ValueError naming the folder when it holds none."""
    jobs = []
    for metrics_file in sorted(sweep_dir.glob("*/logs/metrics.jsonl"), key=_job_order):
        job_dir = metrics_file.parent.parent
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        listed = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        overrides = dict(item.partition("=")[::2] for item in listed or [])
        rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        jobs.append(Job(job_dir, overrides, rows))
    if not jobs:
        raise ValueError(
            f"{sweep_dir} holds no job folders with logs/metrics.jsonl, nor a sweep-<time> folder with them; give "
            "the folder a multirun wrote (output/rlvr/sweep-<time>) or its run's folder (output/rlvr: the latest)"
        )
    return jobs


def _job_order(path: Path) -> tuple[int, str]:
    name = path.parent.parent.name
    return (int(name), name) if name.isdigit() else (sys.maxsize, name)


def swept_keys(jobs: list[Job]) -> list[str]:
    """The override keys whose values differ between jobs, in the order the first job lists them."""
    keys = dict.fromkeys(key for job in jobs for key in job.overrides)
    return [key for key in keys if len({job.overrides.get(key) for job in jobs}) > 1]


def group_name(job: Job, keys: list[str]) -> str:
    """The job's values of the swept keys other than the seed ("all" when the sweep varies only the seed)."""
    parts = [f"{key}={job.overrides.get(key, '-')}" for key in keys if key != SEED]
    return " ".join(parts) or "all"


def final_and_best(job: Job, metric: str) -> tuple[float, float] | None:
    """The last and the best logged value of `metric`, or None when the job never logged it."""
    _, values = job.series(metric)
    if not values:
        return None
    return values[-1], (min(values) if lower_is_better(metric) else max(values))


def default_metrics(jobs: list[Job]) -> list[str]:
    """Every held-out metric (`val/...`) some job logged, else the step metrics' score and loss."""
    logged = dict.fromkeys(key for job in jobs for row in job.rows for key in row)
    chosen = [key for key in logged if key.startswith(DEFAULT_PREFIXES)]
    return chosen or [key for key in ("rollout/score_mean", "actor/loss", "loss") if key in logged]


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.4g} ± {statistics.stdev(values):.2g}" if len(values) > 1 else f"{mean:.4g}"


def report(jobs: list[Job], metrics: list[str]) -> str:
    """The markdown tables: one row per job, then one per group with the mean and spread over its seeds."""
    keys = swept_keys(jobs)
    header = ["job", *keys, *(f"{m} {kind}" for m in metrics for kind in ("final", "best"))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    groups: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for job in jobs:
        cells = [job.path.name, *(job.overrides.get(key, "-") for key in keys)]
        per_group = groups.setdefault(group_name(job, keys), {m: [] for m in metrics})
        for metric in metrics:
            values = final_and_best(job, metric)
            cells += [f"{v:.4g}" for v in values] if values else ["-", "-"]
            if values:
                per_group[metric].append(values)
        lines.append("| " + " | ".join(cells) + " |")
    seeds = "seeds" if SEED in keys else "jobs"
    lines += ["", f"| group | {seeds} | " + " | ".join(header[1 + len(keys) :]) + " |"]
    lines.append("|" + "---|" * (2 + 2 * len(metrics)))
    for name, by_metric in groups.items():
        count = max((len(v) for v in by_metric.values()), default=0)
        cells = [name, str(count)]
        for metric in metrics:
            pairs = by_metric[metric]
            cells += [_spread([p[i] for p in pairs]) if pairs else "-" for i in (0, 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(jobs: list[Job], metrics: list[str], out_dir: Path) -> list[Path]:
    """One PNG per metric with every job's curve, one colour per group; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(jobs)
    names = list(dict.fromkeys(group_name(job, keys) for job in jobs))
    paths = []
    for metric in metrics:
        figure, axis = plt.subplots(figsize=(6, 3.6))
        labelled: set[str] = set()
        for job in jobs:
            steps, values = job.series(metric)
            if not steps:
                continue
            name = group_name(job, keys)
            axis.plot(steps, values, color=f"C{names.index(name) % 10}", label=None if name in labelled else name)
            labelled.add(name)
        axis.set_xlabel("step")
        axis.set_ylabel(metric)
        axis.grid(alpha=0.3)
        if labelled:
            axis.legend(fontsize=7)
        figure.tight_layout()
        path = out_dir / f"sweep_{metric.replace('/', '_')}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    """Write and print the report of the sweep folder given on the command line."""
    parser = argparse.ArgumentParser(prog="roll-sweep-report", description=__doc__)
    parser.add_argument(
        "sweep_dir", type=Path, help="a multirun's folder (output/rlvr/sweep-<time>), or its run's (its latest sweep)"
    )
    parser.add_argument("--metric", action="append", help="a metric to compare (repeatable; default: val/...)")
    args = parser.parse_args(argv)
    sweep = sweep_folder(args.sweep_dir)
    try:
        jobs = read_jobs(sweep)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    metrics = args.metric or default_metrics(jobs)
    logged = {key for job in jobs for row in job.rows for key in row}
    unknown = [metric for metric in metrics if metric not in logged]
    if unknown or not metrics:
        available = ", ".join(sorted(k for k in logged if k != "step"))
        parser.exit(2, f"error: no job logged {', '.join(unknown) or 'a metric to compare'}; logged: {available}\n")
    text = report(jobs, metrics)
    (sweep / "sweep_report.md").write_text(text + "\n")
    plots = plot(jobs, metrics, sweep)
    print(text)
    print(f"\nwritten: {sweep / 'sweep_report.md'}, {len(plots)} plot(s) in {sweep}")


if __name__ == "__main__":
    main()
