"""External trackers: the config check names a missing package, and MetricsTracker feeds every adapter.

wandb, swanlab and mlflow are not dependencies of roll: fake modules in sys.modules record what each
adapter calls, in the shape of the packages' own APIs (checked against the real packages by hand, as
docs/trackers.md records).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from roll.configs.schema import ConfigError
from roll.utils.external_trackers import MLFLOW_PARAM_LENGTH, mlflow_params
from roll.utils.tracking import MetricsTracker
from tests.unit.test_config_validation import rlvr


def fake_module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for attribute, value in attributes.items():
        setattr(module, attribute, value)
    return module


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[Any, ...]]]:
    calls: dict[str, list[tuple[Any, ...]]] = {"wandb": [], "swanlab": [], "mlflow": []}
    w, s, m = calls["wandb"], calls["swanlab"], calls["mlflow"]

    class WandbRun:
        def log(self, data: dict, step: int) -> None:
            w.append(("log", data, step))

        def finish(self) -> None:
            w.append(("finish",))

    def wandb_init(**kwargs: Any) -> WandbRun:
        w.append(("init", kwargs))
        return WandbRun()

    modules = {
        "wandb": fake_module("wandb", init=wandb_init, Table=lambda columns, data: ("table", columns, data)),
        "swanlab": fake_module(
            "swanlab",
            init=lambda **kwargs: s.append(("init", kwargs)),
            log=lambda data, step: s.append(("log", data, step)),
            Text=lambda text: ("text", text),
            finish=lambda: s.append(("finish",)),
        ),
        "mlflow": fake_module(
            "mlflow",
            set_tracking_uri=lambda uri: m.append(("uri", uri)),
            get_experiment_by_name=lambda name: None,
            create_experiment=lambda name, artifact_location: m.append(("create", name, artifact_location)),
            set_experiment=lambda name: m.append(("experiment", name)),
            start_run=lambda run_name: m.append(("start", run_name)),
            log_params=lambda params: m.append(("params", params)),
            log_dict=lambda data, path: m.append(("dict", data, path)),
            log_metrics=lambda data, step: m.append(("log", data, step)),
            log_table=lambda data, artifact_file: m.append(("table", data, artifact_file)),
            end_run=lambda: m.append(("end",)),
        ),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return calls


def test_every_tracker_gets_config_metrics_samples_and_close(fakes: dict, tmp_path: Path) -> None:
    config = {"exp_name": "demo", "algorithm": {"adv_estimator": "grpo"}, "data": {"domain_weights": {}}}
    tracker = MetricsTracker(
        str(tmp_path / "logs"), trackers=["tensorboard", "wandb", "swanlab", "mlflow"], run_name="demo", config=config
    )
    tracker.log({"rollout/score_mean": 0.5, "actor/kl": math.nan}, step=1)
    tracker.log_samples(["prompt", "response", "answer", "score"], [["1+1=", "2", "2", 1.0]], step=1)
    tracker.close()
    w, s, m = fakes["wandb"], fakes["swanlab"], fakes["mlflow"]
    assert w[0][1]["config"] == config and w[0][1]["name"] == "demo"
    assert w[1:] == [
        ("log", {"rollout/score_mean": 0.5}, 1),  # NaN stays in metrics.jsonl, not in the trackers
        ("log", {"samples": ("table", ["prompt", "response", "answer", "score"], [["1+1=", "2", "2", 1.0]])}, 1),
        ("finish",),
    ]
    assert s[0][1]["config"] == config and s[0][1]["experiment_name"] == "demo"
    assert s[1] == ("log", {"rollout/score_mean": 0.5}, 1)
    assert json.loads(s[2][1]["samples"][0][1]) == {"prompt": "1+1=", "response": "2", "answer": "2", "score": 1.0}
    assert s[3] == ("finish",)
    # Offline: a local SQLite store (MLflow 3 refuses its file store) with the artifacts beside it, not in the cwd.
    assert m[0] == ("uri", f"sqlite:///{(tmp_path / 'logs' / 'mlflow.db').resolve()}")
    assert m[1] == ("create", "roll", (tmp_path / "logs" / "mlartifacts").resolve().as_uri())
    assert m[2:] == [
        ("experiment", "roll"),
        ("start", "demo"),
        ("params", {"exp_name": "demo", "algorithm.adv_estimator": "grpo", "data.domain_weights": "{}"}),
        ("dict", config, "config.json"),
        ("log", {"rollout/score_mean": 0.5}, 1),
        ("table", {"prompt": ["1+1="], "response": ["2"], "answer": ["2"], "score": [1.0]}, "samples/step_1.json"),
        ("end",),
    ]
    assert json.loads((tmp_path / "logs" / "samples.jsonl").read_text())["response"] == "2"
    assert (tmp_path / "logs" / "tensorboard").is_dir()


def test_tracker_names_and_missing_packages_are_config_errors(fakes: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    assert rlvr("tracker=[tensorboard,wandb,mlflow]").trackers == ["tensorboard", "wandb", "mlflow"]
    with pytest.raises(ConfigError, match=r"^tracker='tensorbord': 'tensorbord' is not one of .*did you mean"):
        rlvr("tracker=tensorbord")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "swanlab" else find_spec(name))
    with pytest.raises(ConfigError) as error:
        rlvr("tracker=[wandb,swanlab]")
    assert str(error.value) == (
        "tracker=swanlab needs the swanlab package, which is not installed: pip install swanlab "
        "(or remove swanlab from tracker)"
    )


def test_mlflow_params_are_the_flattened_config_cut_to_mlflows_limit() -> None:
    long_prompt = "x" * (MLFLOW_PARAM_LENGTH + 1)
    config = {"seed": 1, "data": {"system_prompt": long_prompt, "train_file": ["a.jsonl", "b.jsonl"]}}
    assert mlflow_params(config) == {
        "seed": "1",
        "data.system_prompt": long_prompt[:MLFLOW_PARAM_LENGTH],
        "data.train_file": "['a.jsonl', 'b.jsonl']",
    }
