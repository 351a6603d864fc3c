"""Shared fixtures: one embedded Ray per test process (pytest-xdist runs two), sized for CPU device slots."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "examples" / "config"

# Ray workers import test-defined Worker classes as `tests.<module>`; they inherit this environment.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Logical CPUs of the test Ray: room for two reservations of device slots and device-less workers. They
# exceed the 2 physical cores on purpose; workers cap their own threads.
RAY_TEST_CPUS = 8
TEST_DEVICES = 4


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """An embedded Ray shared by every test of this test process that needs one."""
    import ray

    from roll.distributed.scheduler.initialize import init_ray

    init_ray(None, "roll-tests", RAY_TEST_CPUS, "cpu")
    yield
    ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The README test first, then the other integration files, then the unit files: the longest work first, so that
    the two test processes finish together (the README test alone takes about 15 min, a unit file seconds)."""
    items.sort(key=lambda item: (item.path.name != "test_readme.py", "unit" in item.path.parts))
