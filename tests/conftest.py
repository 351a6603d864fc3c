"""Shared fixtures: one embedded Ray per test process (pytest-xdist runs two), sized for CPU device slots."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from roll.distributed.scheduler.initialize import use_local_ray_settings
from roll.utils.startup_gc import end_startup

if TYPE_CHECKING:
    from roll.distributed.scheduler.resource_manager import ResourceManager
    from tests.worker_pool import HostPool

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "examples" / "config"

# Ray workers import test-defined Worker classes as `tests.<module>`; they inherit this environment.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The local Ray's settings for every Ray a test starts, including the heads and nodes it starts itself.
use_local_ray_settings()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The tests run with CPython's collector: `import roll` deferred it for the imports of collection only."""
    end_startup()


# Logical CPUs of the test Ray: room for two reservations of device slots and device-less workers. They
# exceed the 2 physical cores on purpose; workers cap their own threads.
RAY_TEST_CPUS = 8
TEST_DEVICES = 4
# Ray returns a killed actor's or a removed placement group's resources asynchronously, within seconds.
RELEASE_WAIT_S = 60
# The session's host pool once a test asked for it (at most one).
_POOLS: list[HostPool] = []


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """An embedded Ray shared by every test of this test process that needs one."""
    import ray

    from roll.distributed.scheduler.initialize import init_ray

    init_ray(None, "roll-tests", RAY_TEST_CPUS, "cpu")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def host_pool(ray_session: None) -> Iterator[HostPool]:
    """Worker processes the strategy tests of this test process start their roles in (tests/worker_pool.py)."""
    from tests.worker_pool import HostPool

    pool = HostPool()
    _POOLS.append(pool)  # for host_pool_trimmed_after_file: a fixture may not be requested during teardown
    yield pool
    _POOLS.remove(pool)
    pool.close()


@pytest.fixture(scope="module")
def resource_manager(ray_session: None) -> Iterator[ResourceManager]:
    """A reservation of two CPU device slots for the test module (a module may define its own instead)."""
    from roll.distributed.scheduler.resource_manager import ResourceManager
    from roll.platforms import get_platform

    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=2, cpus_per_device=1)
    yield manager
    manager.destroy()


@pytest.fixture(scope="module", autouse=True)
def host_pool_trimmed_after_file(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a file whose tests used the host pool: its hosts must be clean, and only the ones most files use stay."""
    yield
    used = any("host_pool" in item.fixturenames for item in request.session.items if item.module is request.module)
    if used and _POOLS:
        _POOLS[0].trim()


@pytest.fixture(scope="module", autouse=True)
def ray_released_between_files() -> Iterator[None]:
    """After a file's tests, wait until its placement groups and actors have given their resources back to the
    session's Ray, so the next file's placements find them free instead of racing a release against its timeout."""
    yield
    import ray

    if not ray.is_initialized():
        return
    deadline = time.monotonic() + RELEASE_WAIT_S
    while (held := held_resources()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if held:  # this file fails; the files after it start on a free Ray, not with its leak
        for group in ray.util.placement_group_table().values():
            if group["state"] != "REMOVED":
                ray.util.remove_placement_group(ray.util.get_placement_group(group["placement_group_id"]))
    assert not held, f"resources still held {RELEASE_WAIT_S} s after the file's tests ended: {held}"


def held_resources() -> dict[str, float]:
    """What the session's Ray has reserved or lent out now (placement groups, actors), by resource."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    return {k: v - free.get(k, 0.0) for k, v in total.items() if k in ("CPU", "GPU") and free.get(k, 0.0) < v}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The README test first, then the other integration files, then the unit files: the longest work first, so that
    the two test processes finish together (the README test alone takes about 15 min, a unit file seconds)."""
    items.sort(key=lambda item: (item.path.name != "test_readme.py", "unit" in item.path.parts))
