"""External experiment trackers (Weights & Biases, SwanLab, MLflow) behind one small interface.

None of their packages is a dependency of roll: each is imported when a run asks for it, and the
config check names the missing package beforehand. Offline use is each package's own setting
(`WANDB_MODE=offline`, `SWANLAB_MODE=offline`; MLflow writes to `<log_dir>/mlflow.db` unless
`MLFLOW_TRACKING_URI` says otherwise). docs/trackers.md says what each stores and how it was checked
against the real packages. The project name comes from `WANDB_PROJECT`,
`SWANLAB_PROJECT` or `MLFLOW_EXPERIMENT_NAME`, else "roll".
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

# Tracker name -> the package that provides it (TensorBoard is always written: it needs no extra package).
TRACKER_PACKAGES: dict[str, str | None] = {
    "tensorboard": None,
    "wandb": "wandb",
    "swanlab": "swanlab",
    "mlflow": "mlflow",
}


def missing_packages(trackers: Iterable[str]) -> dict[str, str]:
    """Tracker name -> its package, for the requested trackers whose package is not installed."""
    return {
        name: package
        for name in trackers
        if (package := TRACKER_PACKAGES[name]) is not None and importlib.util.find_spec(package) is None
    }


class ExternalTracker(Protocol):
    """What MetricsTracker needs of an external tracker."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar `metrics` at `step`."""

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Record a table (e.g. generated samples) under `key` at `step`."""

    def close(self) -> None:
        """Flush and end the run."""


class WandbTracker:
    """A Weights & Biases run."""

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        self.wandb = importlib.import_module("wandb")
        project = os.environ.get("WANDB_PROJECT", "roll")
        self.run = self.wandb.init(project=project, name=run_name, dir=str(log_dir), config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar `metrics` at `step`."""
        self.run.log(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Record a wandb.Table under `key` at `step`."""
        self.run.log({key: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        """Finish the run (an offline run is then ready for `wandb sync`)."""
        self.run.finish()


class SwanlabTracker:
    """A SwanLab experiment."""

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        self.swanlab = importlib.import_module("swanlab")
        project = os.environ.get("SWANLAB_PROJECT", "roll")
        self.run = self.swanlab.init(project=project, experiment_name=run_name, logdir=str(log_dir), config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar `metrics` at `step`."""
        self.swanlab.log(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Record each row as a text entry under `key` (SwanLab has no table type)."""
        texts = [self.swanlab.Text(json.dumps(dict(zip(columns, row, strict=True)))) for row in rows]
        self.swanlab.log({key: texts}, step=step)

    def close(self) -> None:
        """Finish the experiment."""
        self.swanlab.finish()


class MlflowTracker:
    """An MLflow run; without MLFLOW_TRACKING_URI, in the SQLite store `<log_dir>/mlflow.db` with its artifacts
    in `<log_dir>/mlartifacts` (MLflow 3 refuses its older `mlruns` file store unless MLFLOW_ALLOW_FILE_STORE)."""

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        self.mlflow = importlib.import_module("mlflow")
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "roll")
        if "MLFLOW_TRACKING_URI" not in os.environ:
            self.mlflow.set_tracking_uri(f"sqlite:///{(log_dir / 'mlflow.db').resolve()}")
            # Created here because a new experiment's artifacts would otherwise go to ./mlruns under the cwd.
            if self.mlflow.get_experiment_by_name(experiment) is None:
                artifacts = (log_dir / "mlartifacts").resolve().as_uri()
                self.mlflow.create_experiment(experiment, artifact_location=artifacts)
        self.mlflow.set_experiment(experiment)
        self.mlflow.start_run(run_name=run_name)
        self.mlflow.log_params(mlflow_params(config))
        self.mlflow.log_dict(config, "config.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar `metrics` at `step`."""
        self.mlflow.log_metrics(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Record the table as the artifact `<key>/step_<step>.json`."""
        data = {column: [row[i] for row in rows] for i, column in enumerate(columns)}
        self.mlflow.log_table(data=data, artifact_file=f"{key}/step_{step}.json")

    def close(self) -> None:
        """End the run."""
        self.mlflow.end_run()


# MLflow refuses a param value longer than this; the whole config is in the run's config.json artifact anyway.
MLFLOW_PARAM_LENGTH = 6000


def mlflow_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`config` as MLflow params (searchable and compared across runs): nested keys joined by dots, values as
    text, cut to MLflow's limit."""
    params: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            params.update(mlflow_params(value, f"{prefix}{key}."))
        else:
            params[f"{prefix}{key}"] = str(value)[:MLFLOW_PARAM_LENGTH]
    return params


ADAPTERS: dict[str, type] = {"wandb": WandbTracker, "swanlab": SwanlabTracker, "mlflow": MlflowTracker}


def open_trackers(
    trackers: Iterable[str], log_dir: Path, run_name: str, config: dict[str, Any]
) -> list[ExternalTracker]:
    """Start the requested external trackers (TensorBoard is roll.utils.tracking.MetricsTracker's own)."""
    return [ADAPTERS[name](log_dir, run_name, config) for name in trackers if name in ADAPTERS]
