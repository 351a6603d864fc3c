"""Reserve the cluster's devices in a Ray placement group and place role workers on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll.platforms import Platform

# Each worker asks its node's bundle for this sliver of the device resource, so that any number of
# colocated roles (up to 1/share) fit on the same devices; how much compute a worker really uses is
# set by its thread cap and visible devices, not by Ray's accounting.
COLOCATION_SHARE = 0.01


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker runs: its node, that node's bundle, and its devices (global and node-local)."""

    node_rank: int
    devices: list[int]
    local_devices: list[int]
    ray_options: dict[str, Any] = field(hash=False, compare=False)


class ResourceManager:
    """One placement group with a bundle per node holding all of that node's devices.

    `devices_per_node` GPUs (or slots of `cpus_per_device` cores) are reserved on each of
    `num_nodes` nodes; global device `d` is local device `d % devices_per_node` of node
    `d // devices_per_node`.
    """

    def __init__(
        self,
        platform: Platform,
        num_nodes: int,
        devices_per_node: int,
        cpus_per_device: int,
        timeout_s: float = 60.0,
    ) -> None:
        self.platform = platform
        self.num_nodes = num_nodes
        self.devices_per_node = devices_per_node
        self.cpus_per_device = cpus_per_device
        bundle = {"CPU": float(devices_per_node * cpus_per_device)}
        if platform.is_accelerator:
            bundle[platform.ray_resource] = float(devices_per_node)
        self.placement_group: PlacementGroup = placement_group(
            [dict(bundle) for _ in range(num_nodes)], strategy="STRICT_SPREAD" if num_nodes > 1 else "PACK"
        )
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"Ray could not reserve {num_nodes} node(s) x {bundle} within {timeout_s:.0f}s; the cluster "
                f"has {ray.cluster_resources()}. Lower num_nodes/devices_per_node/cpus_per_device."
            )

    @property
    def total_devices(self) -> int:
        """Devices reserved over all nodes."""
        return self.num_nodes * self.devices_per_node

    def place(self, devices: list[int], devices_per_worker: int) -> list[WorkerPlacement]:
        """Placements for workers taking consecutive groups of `devices_per_worker` of `devices`."""
        placements = []
        for start in range(0, len(devices), devices_per_worker):
            group = devices[start : start + devices_per_worker]
            node = group[0] // self.devices_per_node
            if any(d >= self.total_devices or d // self.devices_per_node != node for d in group):
                raise ValueError(f"devices {group} are not all on one of the {self.num_nodes} reserved nodes")
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=node
            )
            options: dict[str, Any] = {"scheduling_strategy": strategy, "num_cpus": COLOCATION_SHARE}
            if self.platform.is_accelerator:
                options["resources"] = {self.platform.ray_resource: COLOCATION_SHARE}
            placements.append(
                WorkerPlacement(
                    node_rank=node,
                    devices=group,
                    local_devices=[d % self.devices_per_node for d in group],
                    ray_options=options,
                )
            )
        return placements

    def threads_per_worker(self, devices_per_worker: int) -> int:
        """Torch threads a worker may use: the cores of its device slots."""
        return max(1, devices_per_worker * self.cpus_per_device)

    def destroy(self) -> None:
        """Release the reservation."""
        remove_placement_group(self.placement_group)
