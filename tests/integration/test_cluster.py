"""Worker clusters on a real embedded Ray with CPU device slots."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray
import torch

from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
from roll.pipeline.cluster_check.cluster_check_pipeline import ClusterCheckPipeline
from roll.platforms import get_platform
from tests.conftest import TEST_DEVICES

ECHO = "tests.cluster_workers.EchoWorker"


@pytest.fixture(scope="module")
def resource_manager(ray_session: None) -> Iterator[ResourceManager]:
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=TEST_DEVICES, cpus_per_device=1)
    yield manager
    manager.destroy()


def start(name: str, manager: ResourceManager | None, worker_cls: str = ECHO, **fields: object) -> Cluster:
    config = WorkerConfig(worker_cls=worker_cls, **fields)
    config.resolve(name, TEST_DEVICES)
    return Cluster(worker_cls, config, manager)


@pytest.fixture(scope="module")
def pair(resource_manager: ResourceManager) -> Iterator[Cluster]:
    cluster = start("pair", resource_manager, device_mapping="0-1")
    yield cluster
    cluster.shutdown()


def test_ranks_get_rendezvous_environment_and_thread_cap(pair: Cluster) -> None:
    envs = pair.environment()
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
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


def test_colocated_roles_share_device_slots(resource_manager: ResourceManager, pair: Cluster) -> None:
    free_before = ray.available_resources().get("CPU", 0.0)
    guest = start("guest", resource_manager, device_mapping="0-1")
    other = start("other", resource_manager, device_mapping="2-3")
    try:
        assert guest.whoami() == 0 and other.whoami() == 0
        pids = {w["pid"] for c in (pair, guest, other) for w in c.describe()}
        assert len(pids) == 6
        # Colocation uses the devices already reserved: only slivers of CPU are taken, not new slots.
        assert free_before - ray.available_resources().get("CPU", 0.0) < 0.1
    finally:
        guest.shutdown()
        other.shutdown()


def test_gather_is_tensor_parallel_aware(resource_manager: ResourceManager) -> None:
    cluster = start(
        "tp",
        resource_manager,
        worker_cls="tests.cluster_workers.TensorParallelEchoWorker",
        device_mapping="0-3",
    )
    try:
        out = cluster.add_rank(DataProto.from_dict(tensors={"x": torch.arange(6)}))
        assert out.batch["x"].tolist() == list(range(6))
        assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2, 2]  # dp leads are ranks 0 and 2
    finally:
        cluster.shutdown()


def test_role_without_devices_runs_outside_the_reservation(ray_session: None) -> None:
    cluster = start("rewards", None, world_size=2, num_cpus_per_worker=1.0)
    try:
        assert [e["RANK"] for e in cluster.environment()] == ["0", "1"]
    finally:
        cluster.shutdown()


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


def test_shutdown_closes_every_worker_then_frees_its_cpus(ray_session: None, tmp_path) -> None:
    before = ray.available_resources().get("CPU", 0)
    marker = str(tmp_path / "closed-")
    cluster = start(
        "closing", None, "tests.cluster_workers.ClosingWorker", world_size=2, env_vars={"CLOSED_MARKER": marker}
    )
    assert cluster.whoami() == 0
    cluster.shutdown()
    assert [(tmp_path / f"closed-{rank}").read_text() for rank in (0, 1)] == ["closed", "closed"]
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= before


def test_a_registered_method_may_not_shadow_the_cluster(ray_session: None) -> None:
    with pytest.raises(TypeError, match=r"ShadowingWorker\.shutdown is registered but Cluster has its own"):
        start("shadow", None, "tests.cluster_workers.ShadowingWorker", world_size=1)
