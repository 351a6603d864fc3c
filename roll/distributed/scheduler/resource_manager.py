"""Reserve every actor of a run in one Ray placement group and place role workers in it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll.configs.worker_config import WorkerConfig
from roll.distributed.scheduler.placement import (
    ClusterShape,
    NodeResources,
    PlacementError,
    PlacementPlan,
    RankPlacement,
    plan_placement,
    rank_placements,
)
from roll.platforms import Platform

# Each worker asks its node's bundle for this sliver of the device resource, so that any number of
# colocated roles (up to 1/share) fit on the same devices; how much compute a worker really uses is
# set by its thread cap and visible devices, not by Ray's accounting.
COLOCATION_SHARE = 0.01


@dataclass(frozen=True)
class WorkerPlacement:
    """One rank's place in the plan, the environment that follows from it and the Ray options that put it there.

    `env` holds LOCAL_RANK and, on accelerators, the worker's visible devices. LOCAL_RANK is the
    rank's position among its role's ranks on its node, except for a worker that sees only its own
    accelerators (roll sets CUDA_VISIBLE_DEVICES and the like per worker): there it is 0, the
    ordinal of its first device, because torch.distributed, DeepSpeed and roll's strategies open
    device LOCAL_RANK.
    """

    place: RankPlacement
    env: dict[str, str]
    ray_options: dict[str, Any]


class ResourceManager:
    """One placement group holding every actor of a run, with one bundle per node of the placement plan.

    Each of `num_nodes` nodes holds `devices_per_node` GPUs (or slots of `cpus_per_device` cores);
    global device `d` is local device `d % devices_per_node` of node `d // devices_per_node`. The
    device-less workers of `roles` (e.g. reward workers) get their CPUs in the bundle of the node the
    plan puts them on. Before asking Ray, the plan is checked against the alive nodes' resources;
    a cluster too small, or a reservation Ray does not grant within `timeout_s`, raises PlacementError.
    """

    def __init__(
        self,
        platform: Platform,
        num_nodes: int,
        devices_per_node: int,
        cpus_per_device: int,
        timeout_s: float = 120.0,
        roles: Mapping[str, WorkerConfig] | None = None,
    ) -> None:
        self.platform = platform
        self.num_nodes = num_nodes
        self.devices_per_node = devices_per_node
        self.cpus_per_device = cpus_per_device
        shape = ClusterShape(
            num_nodes, devices_per_node, cpus_per_device, platform.ray_resource if platform.is_accelerator else None
        )
        self.plan: PlacementPlan = plan_placement(shape, roles or {}, NodeResources.from_ray(ray.nodes()))
        self.placement_group: PlacementGroup = placement_group(self.plan.bundles(), strategy=self.plan.strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.placement_group)
            counted = ("CPU", self.plan.shape.device_resource)
            free = ", ".join(f"{v:g} {k}" for k, v in sorted(ray.available_resources().items()) if k in counted)
            raise PlacementError(
                f"Ray did not grant this run's reservation within placement_timeout_s={timeout_s:g}: "
                f"{self.plan.describe_demand()}; {self.plan.describe_cluster()}; free now: {free or 'nothing'}. "
                "The cluster is big enough, so other jobs or actors hold the rest: let them finish, lower what the "
                "roles ask for, or raise placement_timeout_s"
            )

    @property
    def total_devices(self) -> int:
        """Devices reserved over all nodes."""
        return self.num_nodes * self.devices_per_node

    def place(self, role: WorkerConfig) -> list[WorkerPlacement]:
        """Every rank of `role` (resolved): where the plan puts it and how its actor gets there."""
        if role.devices:
            ranks = rank_placements(role.name, role.devices, role.num_devices_per_worker, self.plan.shape)
        elif role.name in self.plan.roles:
            ranks = list(self.plan.roles[role.name])
        else:
            raise ValueError(f"{role.name} has no device_mapping and is not in the plan: pass it in roles=")
        return [WorkerPlacement(place=rank, env=self._env(rank), ray_options=self._options(rank)) for rank in ranks]

    def _env(self, rank: RankPlacement) -> dict[str, str]:
        if not rank.devices:
            return {"LOCAL_RANK": str(rank.local_rank)}
        env = self.platform.visible_devices_environ(list(rank.local_devices))
        visible = self.platform.visible_devices_env
        if not visible:  # CPU slots: every rank's device is `cpu`, so LOCAL_RANK is free to count the node's ranks
            return env | {"LOCAL_RANK": str(rank.local_rank)}
        env["RAY_EXPERIMENTAL_NOSET_" + visible] = "1"  # roll, not Ray, decides which devices a worker sees
        return env | {"LOCAL_RANK": "0"}

    def _options(self, rank: RankPlacement) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=rank.node
        )
        if not rank.devices:
            return {"scheduling_strategy": strategy, "num_cpus": rank.cpus}
        options: dict[str, Any] = {"scheduling_strategy": strategy, "num_cpus": COLOCATION_SHARE}
        if self.platform.is_accelerator:
            options["resources"] = {self.platform.ray_resource: COLOCATION_SHARE}
        return options

    def threads_per_worker(self, devices_per_worker: int) -> int:
        """Torch threads a worker may use: the cores of its device slots."""
        return max(1, devices_per_worker * self.cpus_per_device)

    def destroy(self) -> None:
        """Release the reservation."""
        remove_placement_group(self.placement_group)
