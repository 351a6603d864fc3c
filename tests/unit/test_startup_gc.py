"""The collector is deferred while a roll process starts and put back where its start-up ends."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from roll.utils import startup_gc
from tests.conftest import REPO_ROOT

# A new process's thresholds before `import roll`, after it, and after `{start}` ends its start-up.
MEASURED_START = """
import contextlib, gc, json, types
before = gc.get_threshold()
import roll
deferred = gc.get_threshold()
{start}
print(json.dumps([before, deferred, gc.get_threshold()]))
"""
# A worker's constructor.
WORKER_START = MEASURED_START.format(
    start="""
from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.worker import Worker
config = WorkerConfig(worker_cls="roll.distributed.executor.worker.Worker", world_size=1)
config.resolve("probe", 1)
Worker(config, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
"""
)
# A driver's pipeline constructor, here refusing two nodes without a Ray cluster before Ray starts.
DRIVER_START = MEASURED_START.format(
    start="""
from roll.configs.schema import ConfigError
from roll.pipeline.base.pipeline import BasePipeline
class Probe(BasePipeline):
    def run(self): pass
with contextlib.suppress(ConfigError):
    Probe(types.SimpleNamespace(platform="cpu", ray_address=None, num_nodes=2))
"""
)


def thresholds_of_a_start(program: str, **env: str) -> list[tuple[int, ...]]:
    run = subprocess.run(
        [sys.executable, "-c", program],
        cwd=REPO_ROOT,
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [tuple(t) for t in json.loads(run.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("program", [WORKER_START, DRIVER_START], ids=["worker", "driver"])
def test_importing_roll_defers_the_collector_until_a_worker_or_pipeline_starts(program: str) -> None:
    before, deferred, started = thresholds_of_a_start(program)
    assert deferred == (startup_gc.DEFERRED_THRESHOLD, *before[1:])
    assert started == before


def test_roll_defer_gc_0_leaves_cpythons_thresholds() -> None:
    before, deferred, started = thresholds_of_a_start(WORKER_START, ROLL_DEFER_GC="0")
    assert deferred == started == before


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's collector as a process that has not imported roll yet has it; restored after the test."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    monkeypatch.setattr(startup_gc, "_thresholds_before", None)
    monkeypatch.delenv("ROLL_DEFER_GC", raising=False)
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()


def test_deferring_twice_keeps_the_first_thresholds_and_ending_twice_changes_nothing(fresh_state: None) -> None:
    startup_gc.defer_collection()
    startup_gc.defer_collection()
    assert gc.get_threshold() == (startup_gc.DEFERRED_THRESHOLD, 10, 10)
    startup_gc.end_startup()
    assert gc.get_threshold() == (700, 10, 10)
    gc.set_threshold(900, 10, 10)  # the process's own choice after start-up
    startup_gc.end_startup()
    assert gc.get_threshold() == (900, 10, 10)


@pytest.mark.parametrize("own", ["higher threshold", "collector off"])
def test_a_process_that_chose_its_own_collection_keeps_it(fresh_state: None, own: str) -> None:
    if own == "collector off":
        gc.disable()
    else:
        gc.set_threshold(startup_gc.DEFERRED_THRESHOLD * 2, 5, 5)
    chosen = gc.get_threshold()
    startup_gc.defer_collection()
    assert gc.get_threshold() == chosen
    startup_gc.end_startup()
    assert gc.get_threshold() == chosen
