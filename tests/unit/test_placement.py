"""The placement plan, computed from roles and a description of the nodes without Ray."""

from __future__ import annotations

import re

import pytest

from roll.configs.worker_config import WorkerConfig
from roll.distributed.scheduler.placement import (
    ClusterShape,
    NodeResources,
    PlacementError,
    RankPlacement,
    plan_placement,
    rank_placements,
)

WORKER = "roll.pipeline.base.rl_workers.ActorWorker"
GIB = 2**30


def role(name: str, total_devices: int, **fields: object) -> WorkerConfig:
    config = WorkerConfig(worker_cls=WORKER, **fields)
    config.resolve(name, total_devices)
    return config


def node(last: int, **resources: float) -> NodeResources:
    return NodeResources(f"{last:02x}" * 14, f"10.0.0.{last}", {"memory": 8.0 * GIB, **resources})


def rlvr_roles(total_devices: int, reward_cpus: float = 1.0) -> dict[str, WorkerConfig]:
    """actor_train and actor_infer on every device, one reward worker: the default RLVR run's shape."""
    mapping = f"0-{total_devices - 1}"
    return {
        "actor_train": role("actor_train", total_devices, device_mapping=mapping),
        "actor_infer": role("actor_infer", total_devices, device_mapping=mapping),
        "rewards.math": role("rewards.math", total_devices, world_size=1, num_cpus_per_worker=reward_cpus),
    }


def test_ranks_count_local_ranks_within_their_node() -> None:
    shape = ClusterShape(num_nodes=2, devices_per_node=4, cpus_per_device=1)
    ranks = rank_placements("actor_infer", [0, 1, 2, 3, 4, 5], 2, shape)
    assert [(r.node, r.devices, r.local_devices, r.local_rank, r.local_world_size) for r in ranks] == [
        (0, (0, 1), (0, 1), 0, 2),
        (0, (2, 3), (2, 3), 1, 2),
        (1, (4, 5), (0, 1), 0, 1),
    ]


@pytest.mark.parametrize(
    ("devices", "per_worker", "message"),
    [
        ([1, 2], 2, r"actor_train: worker 0 spans nodes \[0, 1\]; a worker's 2 devices must lie on one node of 2"),
        ([2, 3, 0, 1], 1, r"actor_train.device_mapping puts rank 2 on node 0 after rank 1 on node 1; .* node order"),
        ([3, 4], 1, r"actor_train.device_mapping uses device\(s\) \[4\] but the cluster has 4"),
    ],
)
def test_a_device_mapping_that_cannot_be_placed_is_an_error(devices: list[int], per_worker: int, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        rank_placements("actor_train", devices, per_worker, ClusterShape(2, 2, 1))


def test_without_nodes_device_less_workers_join_node_zero() -> None:
    roles = {**rlvr_roles(4), "rewards.code": role("rewards.code", 4, world_size=2, num_cpus_per_worker=0.5)}
    plan = plan_placement(ClusterShape(2, 2, 2), roles)
    assert plan.bundles() == [{"CPU": 4.0 + 1.0 + 1.0}, {"CPU": 4.0}]
    assert plan.total_cpus == 10 and plan.strategy == "STRICT_SPREAD"
    assert plan.roles["rewards.code"] == (
        RankPlacement(rank=0, node=0, local_rank=0, local_world_size=2, cpus=0.5),
        RankPlacement(rank=1, node=0, local_rank=1, local_world_size=2, cpus=0.5),
    )
    assert [r.node for r in plan.roles["actor_train"]] == [0, 0, 1, 1]
    assert plan.cluster is None and all(n.host is None for n in plan.nodes)


def test_one_cpu_per_node_has_no_room_for_the_reward_worker() -> None:
    """The issue's cluster: 2 nodes of 1 CPU, 1 device slot of 1 CPU each, and a reward worker of 1 CPU."""
    nodes = [node(2, CPU=1.0), node(3, CPU=1.0)]
    with pytest.raises(PlacementError) as caught:
        plan_placement(ClusterShape(2, 1, 1), rlvr_roles(2), nodes)
    message = str(caught.value)
    assert "\n" not in message
    for part in (
        "device slots need 1 CPU on each of 2 nodes (num_nodes=2 x devices_per_node=1 x cpus_per_device=1)",
        "shared by actor_train (2 ranks on nodes 0, 1), actor_infer (2 ranks on nodes 0, 1)",
        "rewards.math needs 1 worker x 1 CPU (rewards.math.world_size x rewards.math.num_cpus_per_worker)",
        "(3 CPU in all)",
        "the cluster has 2 alive nodes (2 CPU in all): 10.0.0.2 (node 02020202): 1 CPU, 8.0 GiB memory; 10.0.0.3",
        "A rewards.math worker needs 1 CPU beside the device slots and no node has that much left (the most is 0 CPU)",
    ):
        assert part in message, part
    # Nothing smaller would fit: no CPU is left beside the slots, and the slots cannot shrink.
    assert message.endswith("Fix: add nodes or CPUs")


@pytest.mark.parametrize(
    ("cpus_per_node", "cpus_per_device", "world_size", "fix"),
    [
        (1.5, 1, 1, "Fix: lower rewards.math.num_cpus_per_worker to 0.5 or add nodes or CPUs"),
        (2.0, 1, 3, "Fix: lower rewards.math.world_size to 2 or add nodes or CPUs"),
        (2.0, 2, 1, "Fix: lower cpus_per_device or add nodes or CPUs"),
    ],
)
def test_the_fix_names_the_overrides_that_would_fit(
    cpus_per_node: float, cpus_per_device: int, world_size: int, fix: str
) -> None:
    roles = {**rlvr_roles(2), "rewards.math": role("rewards.math", 2, world_size=world_size)}
    nodes = [node(2, CPU=cpus_per_node), node(3, CPU=cpus_per_node)]
    with pytest.raises(PlacementError, match=rf"{re.escape(fix)}$"):
        plan_placement(ClusterShape(2, 1, cpus_per_device), roles, nodes)


def test_two_cpus_per_node_hold_slots_and_reward_worker() -> None:
    nodes = [node(2, CPU=2.0), node(3, CPU=2.0)]
    plan = plan_placement(ClusterShape(2, 1, 1), rlvr_roles(2), nodes)
    assert plan.bundles() == [{"CPU": 2.0}, {"CPU": 1.0}]
    assert plan.roles["rewards.math"][0].node == 0
    assert [n.host.address for n in plan.nodes if n.host] == ["10.0.0.2", "10.0.0.3"]


def test_fractional_reward_cpus_fit_beside_the_slots() -> None:
    nodes = [node(2, CPU=1.5), node(3, CPU=1.0)]
    plan = plan_placement(ClusterShape(2, 1, 1), rlvr_roles(2, reward_cpus=0.5), nodes)
    assert plan.bundles() == [{"CPU": 1.5}, {"CPU": 1.0}]


def test_device_less_workers_spill_onto_a_node_without_device_slots() -> None:
    nodes = [node(2, CPU=1.0), node(3, CPU=1.0), node(4, CPU=4.0)]
    plan = plan_placement(ClusterShape(1, 1, 1), rlvr_roles(1, reward_cpus=3.0), nodes)
    # The 4-CPU node holds the device slot (most CPUs first) and the reward worker beside it.
    assert plan.bundles() == [{"CPU": 4.0}] and plan.nodes[0].host.address == "10.0.0.4"
    plan = plan_placement(ClusterShape(2, 1, 1), rlvr_roles(2, reward_cpus=3.0), nodes)
    assert plan.bundles() == [{"CPU": 4.0}, {"CPU": 1.0}]
    roles = {**rlvr_roles(2), "rewards.math": role("rewards.math", 2, world_size=4, num_cpus_per_worker=1.0)}
    plan = plan_placement(ClusterShape(2, 1, 1), roles, nodes)
    # Three workers beside the 4-CPU node's slot, the fourth on a node of its own: a third bundle.
    assert plan.bundles() == [{"CPU": 4.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert [r.node for r in plan.roles["rewards.math"]] == [0, 0, 0, 2]
    assert plan.nodes[2].device_slots == 0 and plan.strategy == "STRICT_SPREAD"


def test_nodes_with_different_gpu_counts() -> None:
    shape = ClusterShape(2, 2, 1, device_resource="GPU")
    roles = rlvr_roles(4)
    # More GPUs than devices_per_node: the node holds its slots and the rest stay free.
    plan = plan_placement(shape, roles, [node(2, CPU=8.0, GPU=4.0), node(3, CPU=8.0, GPU=2.0)])
    assert plan.bundles() == [{"CPU": 3.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}]
    # Fewer: rejected, naming what each node has.
    with pytest.raises(PlacementError) as caught:
        plan_placement(shape, roles, [node(2, CPU=8.0, GPU=2.0), node(3, CPU=8.0, GPU=1.0), node(4, CPU=16.0)])
    message = str(caught.value)
    assert "device slots need 2 CPU, 2 GPU on each of 2 nodes" in message
    assert "10.0.0.3 (node 03030303): 8 CPU, 1 GPU, 8.0 GiB memory" in message
    assert "Only 1 of the 3 nodes can hold one node's device slots (2 CPU and 2 GPU)" in message
    assert message.endswith(
        "Fix: lower devices_per_node (with device mappings that fit), lower num_nodes to 1 (with device mappings "
        "that fit) or add nodes with 2 CPU and 2 GPU or more"
    )


def test_alive_nodes_are_read_from_ray_nodes() -> None:
    answer = [
        {"NodeID": "aa" * 14, "NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": {"CPU": 2.0}},
        {"NodeID": "bb" * 14, "NodeManagerAddress": "10.0.0.2", "Alive": False, "Resources": {"CPU": 8.0}},
    ]
    assert NodeResources.from_ray(answer) == [NodeResources("aa" * 14, "10.0.0.1", {"CPU": 2.0})]


def test_plan_lines_name_every_rank() -> None:
    plan = plan_placement(ClusterShape(2, 1, 1), rlvr_roles(2), [node(2, CPU=2.0), node(3, CPU=2.0)])
    lines = plan.format()
    assert lines[0] == "node 0: 1 device slot(s), reserves 2 CPU on 10.0.0.2 (node 02020202): 2 CPU, 8.0 GiB memory"
    assert "actor_train rank 1: node 1, devices [1] (local [0]), local rank 0 of 1" in lines
    assert "rewards.math rank 0: node 0, 1.0 CPU, local rank 0 of 1" in lines
