"""The environment a local Ray's daemons start with (roll/distributed/scheduler/initialize.py): spare settings
for an embedded Ray unless the user set them, and nothing changed when joining a cluster someone else started."""

from __future__ import annotations

import os

import pytest
import ray

from roll.distributed.scheduler import initialize
from roll.distributed.scheduler.initialize import LOCAL_RAY_ENV


@pytest.fixture
def environment_at_start(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The process environment as it was when `ray.init` was called (its daemons inherit it); none of
    LOCAL_RAY_ENV's variables set before."""
    seen: dict[str, str] = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(os.environ))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name in LOCAL_RAY_ENV:
        monkeypatch.delenv(name, raising=False)
    return seen


def test_an_embedded_ray_starts_no_idle_workers_and_lists_logs_less_often(
    environment_at_start: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_enable_metrics_collection", "1")  # a user who wants Ray's metrics keeps them
    initialize.init_ray(None, "roll", 2, "cpu")
    assert environment_at_start["RAY_prestart_worker_first_driver"] == "0"
    assert environment_at_start["RAY_enable_worker_prestart"] == "0"
    assert environment_at_start["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] == "0"
    assert environment_at_start["RAY_enable_metrics_collection"] == "1"


def test_joining_a_cluster_leaves_the_environment_alone(environment_at_start: dict[str, str]) -> None:
    initialize.init_ray("10.0.0.1:6379", "roll", None, "cpu")
    assert environment_at_start and not set(LOCAL_RAY_ENV) & set(environment_at_start)
