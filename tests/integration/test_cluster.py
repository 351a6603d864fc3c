"""Worker clusters on a real embedded Ray with CPU device slots."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
import torch

from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.actor_exit import end_actors
from roll.distributed.executor.cluster import Cluster, ClusterFuture, WorkerDiedError, get_all
from roll.distributed.scheduler.placement import PlacementError
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
from roll.pipeline.cluster_check.cluster_check_pipeline import ClusterCheckPipeline
from roll.platforms import get_platform
from tests.bare_actors import Peer, Sleeper
from tests.conftest import RAY_TEST_CPUS, TEST_DEVICES

ECHO = "tests.cluster_workers.EchoWorker"


@pytest.fixture(scope="module")
def resource_manager(ray_session: None) -> Iterator[ResourceManager]:
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=TEST_DEVICES, cpus_per_device=1)
    yield manager
    manager.destroy()


def start(name: str, manager: ResourceManager, worker_cls: str = ECHO, **fields: object) -> Cluster:
    config = WorkerConfig(worker_cls=worker_cls, **fields)
    config.resolve(name, TEST_DEVICES)
    return Cluster(worker_cls, config, manager)


@contextmanager
def device_less(name: str, worker_cls: str = ECHO, **fields: object) -> Iterator[tuple[Cluster, ResourceManager]]:
    """A role without devices, started in a reservation of its own (one device slot beside it), then released."""
    config = WorkerConfig(worker_cls=worker_cls, **fields)
    config.resolve(name, 1)
    manager = ResourceManager(get_platform("cpu"), 1, 1, 1, roles={name: config})
    try:
        cluster = Cluster(worker_cls, config, manager)
        try:
            yield cluster, manager
        finally:
            cluster.shutdown()
    finally:
        manager.destroy()


@pytest.fixture(scope="module")
def pair(resource_manager: ResourceManager) -> Iterator[Cluster]:
    cluster = start("pair", resource_manager, device_mapping="0-1")
    yield cluster
    cluster.shutdown()


def test_ranks_get_rendezvous_environment_and_thread_cap(pair: Cluster) -> None:
    envs = pair.environment()
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]  # CPU slots: LOCAL_RANK counts the role's ranks on a node
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert envs[0]["MASTER_ADDR"] and int(envs[0]["MASTER_PORT"]) > 0
    assert {e["threads"] for e in envs} == {"1"} and {e["ROLL_PLATFORM"] for e in envs} == {"cpu"}


def test_dp_compute_splits_and_gathers_in_order(pair: Cluster) -> None:
    batch = DataProto.from_dict(tensors={"x": torch.arange(8)})
    out = pair.add_rank(batch, offset=3)
    assert out.batch["x"].tolist() == list(range(8))
    assert out.batch["y"].tolist() == [10 * i + 3 for i in range(8)]
    assert out.batch["rank"].tolist() == [0] * 4 + [1] * 4
    assert list(out.non_tensor_batch["tag"]) == ["r0"] * 4 + ["r1"] * 4


def test_rank0_and_all_to_all(pair: Cluster) -> None:
    assert pair.whoami() == 0
    assert pair.square([3, 4]) == [9, 16]


def test_non_blocking_calls_overlap(pair: Cluster) -> None:
    started = time.perf_counter()
    first = pair.sleep_then_rank(1.0, blocking=False)
    second = pair.add_rank(DataProto.from_dict(tensors={"x": torch.arange(4)}), blocking=False)
    assert time.perf_counter() - started < 0.5  # neither call waited
    assert first.get(timeout=60) == [0, 1]
    assert second.get(timeout=60).batch["rank"].tolist() == [0, 0, 1, 1]


def test_colocated_roles_share_device_slots_and_gather_is_tensor_parallel_aware(
    resource_manager: ResourceManager, pair: Cluster
) -> None:
    """A 4-rank role beside `pair`: on its 2 slots (ranks 0-1) and on the 2 free ones (ranks 2-3)."""
    free_before = ray.available_resources().get("CPU", 0.0)
    tp = start("tp", resource_manager, "tests.cluster_workers.TensorParallelEchoWorker", device_mapping="0-3")
    try:
        assert tp.whoami() == 0
        pids = {w["pid"] for c in (pair, tp) for w in c.describe()}
        assert len(pids) == 6
        # Colocation uses the devices already reserved: only slivers of CPU are taken, not new slots.
        assert free_before - ray.available_resources().get("CPU", 0.0) < 0.1
        out = tp.add_rank(DataProto.from_dict(tensors={"x": torch.arange(6)}))
        assert out.batch["x"].tolist() == list(range(6))
        assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2, 2]  # dp leads are ranks 0 and 2
    finally:
        tp.shutdown()


def test_a_cluster_too_small_is_an_error_before_anything_is_reserved(ray_session: None) -> None:
    started = time.monotonic()
    with pytest.raises(PlacementError, match=r"too small for this run: device slots need 9 CPU .* 8 CPU"):
        ResourceManager(get_platform("cpu"), 1, RAY_TEST_CPUS + 1, 1)
    assert time.monotonic() - started < 5


def test_a_reservation_ray_cannot_grant_ends_after_the_timeout(resource_manager: ResourceManager) -> None:
    # The cluster could hold it, but the module's reservation keeps TEST_DEVICES of its CPUs.
    slots = RAY_TEST_CPUS - TEST_DEVICES + 1
    started = time.monotonic()
    with pytest.raises(PlacementError, match=rf"within placement_timeout_s=1: device slots need {slots} CPU"):
        ResourceManager(get_platform("cpu"), 1, slots, 1, timeout_s=1)
    assert time.monotonic() - started < 10
    pending = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "PENDING"]
    assert not pending  # the reservation that timed out was removed


@pytest.mark.slow  # 22-39 s on 2 cores: two roles of two ranks start and form their process groups
def test_cluster_check_pipeline_runs_colocated_roles(ray_session: None) -> None:
    config = ClusterCheckConfig(platform="cpu", devices_per_node=2, batch_size=4, rounds=1)
    config.actor_train.device_mapping = "0-1"
    config.actor_infer = WorkerConfig(worker_cls=config.actor_train.worker_cls, device_mapping=[0, 1])
    config.validate()
    pipeline = ClusterCheckPipeline(config)
    try:
        report = pipeline.run()
    finally:
        pipeline.shutdown()
    assert set(report) == {"actor_train", "actor_infer"}
    assert report["actor_train"]["backend"] == "gloo"
    assert report["actor_infer"]["dp_ranks_in_order"] == [0, 0, 1, 1]


def test_role_without_devices_runs_inside_its_reservation_and_shutdown_frees_it(ray_session: None, tmp_path) -> None:
    marker = str(tmp_path / "closed-")
    env = {"CLOSED_MARKER": marker}
    with device_less(
        "closing", "tests.cluster_workers.ClosingWorker", world_size=2, num_cpus_per_worker=1.0, env_vars=env
    ) as (cluster, manager):
        assert [e["RANK"] for e in cluster.environment()] == ["0", "1"]
        assert [e["LOCAL_RANK"] for e in cluster.environment()] == ["0", "1"]
        # The reservation holds the device slot and both workers' CPUs, and the workers use the latter.
        assert manager.plan.bundles() == [{"CPU": 3.0}]
        group = f"CPU_group_{manager.placement_group.id.hex()}"
        # Every rank has answered, so both actors hold their CPU (actors start asynchronously).
        assert cluster.whoami() == 0 and len(cluster.environment()) == 2
        assert ray.available_resources().get(group, 0.0) == pytest.approx(1.0)
        pids = cluster.pid()
        cluster.shutdown()
        assert [(tmp_path / f"closed-closed-{rank}").read_text() for rank in (0, 1)] == ["closed", "closed"]
        deadline = time.monotonic() + 30
        while ray.available_resources().get(group, 0.0) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get(group, 0.0) == pytest.approx(3.0)
        # The processes exited normally (a kill skips atexit handlers, and what they would have written). Ray frees an
        # exiting actor's resources when it disconnects, before its atexit handlers run: under load they can lag.
        exited = [tmp_path / f"closed-exited-{rank}" for rank in (0, 1)]

        def marks() -> list[str | None]:
            return [path.read_text() if path.exists() else None for path in exited]

        while marks() != ["exited", "exited"] and time.monotonic() < deadline + 30:
            time.sleep(0.2)
        assert marks() == ["exited", "exited"]
        # ... and without the interpreter's teardown of their objects (roll.utils.process_exit), which comes after.
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline + 60:
            time.sleep(0.2)
        assert not list(tmp_path.glob("closed-torn-down-*"))


def test_an_actor_that_does_not_exit_in_time_is_killed(ray_session: None) -> None:
    sleeper = ray.remote(num_cpus=0)(Sleeper).remote()
    busy = sleeper.sleep.remote(120)
    started = time.monotonic()
    end_actors([sleeper], timeout_s=1)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(busy, timeout=30)
    assert time.monotonic() - started < 30


def test_a_registered_method_may_not_shadow_the_cluster(ray_session: None) -> None:
    with pytest.raises(TypeError, match=r"ShadowingWorker\.shutdown is registered but Cluster has its own"):
        start("shadow", None, "tests.cluster_workers.ShadowingWorker", world_size=1)  # type: ignore[arg-type]


def test_a_partner_failing_because_a_worker_died_names_the_death(ray_session: None) -> None:
    """The partner's error arrives first; the call set still ends as the death of the worker behind it (a restart
    can then follow), not as the partner's error."""
    sender, receiver = (ray.remote(num_cpus=0)(Peer).remote() for _ in range(2))
    ray.get([sender.ready.remote(), receiver.ready.remote()])  # both started: the partner's error comes first
    futures = [
        ClusterFuture([receiver.die_after.remote(3.0)], lambda results: results, [("receiver rank 0", receiver)]),
        ClusterFuture([sender.lose_peer.remote()], lambda results: results, [("sender rank 0", sender)]),
    ]
    with pytest.raises(WorkerDiedError, match=r"^receiver rank 0 died .*\(and so: "):
        get_all(*futures, abort_grace_s=30)
    ray.kill(sender)
