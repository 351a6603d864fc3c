"""The placement plan: what every actor of a run asks Ray for, on which node, as which rank; pure, without Ray.

The configured device grid is `num_nodes` nodes of `devices_per_node` devices (a device is a GPU or
NPU, or a slot of `cpus_per_device` cores on CPU nodes); global device `d` is local device
`d % devices_per_node` of node `d // devices_per_node`. Each node of the plan is one bundle of the
run's placement group: its device slots with their CPUs, plus the CPUs of the device-less workers
(e.g. reward workers, `num_cpus_per_worker` each) planned on it; a device-less worker that fits on
no device node gets a bundle on another node of the cluster. Device workers take a sliver of their
node's bundle, so colocated roles share it. Engines' helper processes (vLLM's tensor-parallel
workers, a reward worker's scoring process) are child processes of their worker's actor and ask Ray
for nothing.

Given the cluster's alive nodes (`NodeResources.from_ray(ray.nodes())`), `plan_placement` proves the
reservation fits, matching every bundle to a node, or raises a PlacementError saying what each role
asks for, what each node has and which override fixes it. Without nodes (an embedded Ray not yet
started, or a dry run) device-less workers are planned on node 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig

_EPS = 1e-9  # Ray's resource arithmetic is in units of 1e-4; this only absorbs float noise


class PlacementError(ConfigError):
    """The run cannot be placed: the cluster is too small for what the roles ask, or Ray did not grant it in time."""


@dataclass(frozen=True)
class NodeResources:
    """One alive Ray node: its id, its IP address and its total resources (CPU, GPU, NPU, memory in bytes, ...)."""

    node_id: str
    address: str
    resources: Mapping[str, float]

    def get(self, resource: str) -> float:
        """The node's total of `resource` (0 when it has none)."""
        return float(self.resources.get(resource, 0.0))

    @staticmethod
    def from_ray(nodes: Sequence[Mapping[str, Any]]) -> list[NodeResources]:
        """The alive nodes of a `ray.nodes()` answer."""
        return [
            NodeResources(node["NodeID"], node["NodeManagerAddress"], dict(node["Resources"]))
            for node in nodes
            if node.get("Alive")
        ]

    def describe(self, device_resource: str | None) -> str:
        """`<address> (node <id prefix>): <n> CPU[, <n> GPU], <x> GiB memory`."""
        parts = [f"{_number(self.get('CPU'))} CPU"]
        if device_resource:
            parts.append(f"{_number(self.get(device_resource))} {device_resource}")
        parts.append(f"{self.get('memory') / 2**30:.1f} GiB memory")
        return f"{self.address} (node {self.node_id[:8]}): {', '.join(parts)}"


@dataclass(frozen=True)
class ClusterShape:
    """The configured device grid; `device_resource` is Ray's name for the accelerator (GPU, NPU), None on CPU."""

    num_nodes: int
    devices_per_node: int
    cpus_per_device: int
    device_resource: str | None = None

    def node_of(self, device: int) -> int:
        """The node that holds global device `device`."""
        return device // self.devices_per_node

    def slot_bundle(self) -> dict[str, float]:
        """What one node's device slots reserve: their CPUs and, on accelerator nodes, the devices."""
        bundle = {"CPU": float(self.devices_per_node * self.cpus_per_device)}
        if self.device_resource:
            bundle[self.device_resource] = float(self.devices_per_node)
        return bundle


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank of a role runs.

    `node` indexes the plan's nodes (the placement group's bundles); `devices` are global device ids and
    `local_devices` the same devices counted on their node (both empty for a device-less role);
    `local_rank` is the rank's position among its role's ranks on that node, of `local_world_size`.
    `cpus` is what a device-less rank reserves for itself (device ranks share their slots' CPUs: 0).
    """

    rank: int
    node: int
    devices: tuple[int, ...] = ()
    local_devices: tuple[int, ...] = ()
    local_rank: int = 0
    local_world_size: int = 1
    cpus: float = 0.0


@dataclass(frozen=True)
class PlannedNode:
    """One node of the plan, reserved as one bundle; `host` is a cluster node that can hold it (None unchecked)."""

    index: int
    bundle: dict[str, float]
    device_slots: int
    host: NodeResources | None = None


@dataclass(frozen=True)
class PlacementPlan:
    """Every role's ranks on the plan's nodes, and what each node reserves."""

    shape: ClusterShape
    nodes: tuple[PlannedNode, ...]
    roles: dict[str, tuple[RankPlacement, ...]]
    cluster: tuple[NodeResources, ...] | None = field(default=None, compare=False)

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles, one per planned node in order."""
        return [dict(node.bundle) for node in self.nodes]

    @property
    def strategy(self) -> str:
        """Ray's placement strategy: every bundle on a node of its own."""
        return "STRICT_SPREAD" if len(self.nodes) > 1 else "PACK"

    @property
    def total_cpus(self) -> float:
        """CPUs the whole reservation holds."""
        return sum(node.bundle.get("CPU", 0.0) for node in self.nodes)

    def describe_demand(self) -> str:
        """What the run asks for, by role, in one sentence (the first half of a PlacementError)."""
        shape = self.shape
        slots = shape.slot_bundle()
        devices = f", {_number(slots[shape.device_resource])} {shape.device_resource}" if shape.device_resource else ""
        sharing = [
            f"{name} ({_count(len(ranks), 'rank')} on {_nodes_text(ranks)})"
            for name, ranks in self.roles.items()
            if ranks and ranks[0].devices
        ]
        parts = [
            f"device slots need {_number(slots['CPU'])} CPU{devices} on each of {_count(shape.num_nodes, 'node')} "
            f"(num_nodes={shape.num_nodes} x devices_per_node={shape.devices_per_node} x "
            f"cpus_per_device={shape.cpus_per_device})" + (f", shared by {', '.join(sharing)}" if sharing else "")
        ]
        for name, ranks in self.roles.items():
            if ranks and not ranks[0].devices:
                parts.append(
                    f"{name} needs {_count(len(ranks), 'worker')} x {_number(ranks[0].cpus)} CPU "
                    f"({name}.world_size x {name}.num_cpus_per_worker) on {_nodes_text(ranks)}"
                )
        free_cpus = sum(r.cpus for ranks in self.roles.values() for r in ranks)
        return f"{'; '.join(parts)} ({_number(shape.num_nodes * slots['CPU'] + free_cpus)} CPU in all)"

    def describe_cluster(self) -> str:
        """The alive nodes the plan was checked against, in one sentence."""
        if self.cluster is None:
            return "the cluster's nodes were not checked"
        listed = "; ".join(node.describe(self.shape.device_resource) for node in self.cluster)
        cpus = sum(node.get("CPU") for node in self.cluster)
        return f"the cluster has {_count(len(self.cluster), 'alive node')} ({_number(cpus)} CPU in all): {listed}"

    def format(self) -> list[str]:
        """The plan as text lines: each node's bundle and host, then each rank's node, devices and local rank."""
        lines = []
        for node in self.nodes:
            host = f" on {node.host.describe(self.shape.device_resource)}" if node.host else ""
            bundle = ", ".join(f"{_number(v)} {k}" for k, v in node.bundle.items())
            lines.append(f"node {node.index}: {node.device_slots} device slot(s), reserves {bundle}{host}")
        for name, ranks in self.roles.items():
            for r in ranks:
                where = f"devices {list(r.devices)} (local {list(r.local_devices)})" if r.devices else f"{r.cpus} CPU"
                lines.append(
                    f"{name} rank {r.rank}: node {r.node}, {where}, local rank {r.local_rank} of {r.local_world_size}"
                )
        return lines


def rank_placements(
    role: str, devices: Sequence[int], devices_per_worker: int, shape: ClusterShape
) -> list[RankPlacement]:
    """The ranks of a role with devices: rank r takes the r-th group of `devices_per_worker` of `devices`.

    Raise PlacementError when a worker's devices span nodes, lie beyond the grid, or when the ranks
    are not ordered by node (rank r+1 on a lower node than rank r): roll numbers ranks node by node,
    so that ranks that work closely (tensor-parallel groups) are neighbours on one node.
    """
    total = shape.num_nodes * shape.devices_per_node
    ranks: list[RankPlacement] = []
    per_node: Counter[int] = Counter()
    for start in range(0, len(devices), devices_per_worker):
        group = tuple(devices[start : start + devices_per_worker])
        rank = start // devices_per_worker
        beyond = [d for d in group if d >= total]
        if beyond:
            raise PlacementError(
                f"{role}.device_mapping uses device(s) {beyond} but the cluster has {total}; fix "
                f"{role}.device_mapping or raise num_nodes/devices_per_node"
            )
        nodes = sorted({shape.node_of(d) for d in group})
        if len(nodes) > 1:
            raise PlacementError(
                f"{role}: worker {rank} spans nodes {nodes}; a worker's {devices_per_worker} devices must lie on "
                f"one node of {shape.devices_per_node} devices"
            )
        node = nodes[0]
        if ranks and node < ranks[-1].node:
            raise PlacementError(
                f"{role}.device_mapping puts rank {rank} on node {node} after rank {rank - 1} on node "
                f"{ranks[-1].node}; ranks are numbered node by node: list {role}.device_mapping's devices in node "
                f"order (node n holds devices {shape.devices_per_node}n to {shape.devices_per_node}n+"
                f"{shape.devices_per_node - 1})"
            )
        local = tuple(d % shape.devices_per_node for d in group)
        ranks.append(RankPlacement(rank=rank, node=node, devices=group, local_devices=local, local_rank=per_node[node]))
        per_node[node] += 1
    return [replace(r, local_world_size=per_node[r.node]) for r in ranks]


def plan_placement(
    shape: ClusterShape, roles: Mapping[str, WorkerConfig], nodes: Sequence[NodeResources] | None = None
) -> PlacementPlan:
    """Plan every role of a run (resolved WorkerConfigs by name) on the device grid and, if given, the cluster's nodes.

    Raise PlacementError when a device mapping cannot be placed (see `rank_placements`) or when
    `nodes` cannot hold the reservation: fewer nodes than `num_nodes` with room for a node's device
    slots, or a device-less worker that fits nowhere beside them. Device-less workers go, largest
    first, to the first node with room: the device nodes in order, then the other nodes, most CPUs first.
    """
    demand = _demand(shape, roles)
    slots = shape.slot_bundle()
    hosts: list[NodeResources | None] = [None] * shape.num_nodes
    room = [float("inf")] * shape.num_nodes
    spares: list[NodeResources] = []
    if nodes is not None:
        hosts, spares = _device_hosts(shape, demand, nodes)
        room = [host.get("CPU") - slots["CPU"] for host in hosts]
    free = [(name, r.rank, r.cpus) for name, ranks in demand.items() for r in ranks if not r.devices]
    assigned: dict[tuple[str, int], int] = {}
    extra_cpus = [0.0] * shape.num_nodes
    for name, rank, cpus in sorted(free, key=lambda worker: -worker[2]):
        index = next((i for i, left in enumerate(room) if left + _EPS >= cpus), None)
        if index is None and spares and spares[0].get("CPU") + _EPS >= cpus:
            hosts.append(spares.pop(0))
            room.append(hosts[-1].get("CPU"))
            extra_cpus.append(0.0)
            index = len(hosts) - 1
        if index is None:
            most = max([0.0, *(left for left in room if left != float("inf")), *(n.get("CPU") for n in spares)])
            placed = sum(1 for worker in assigned if worker[0] == name)
            fixes = [f"lower {name}.num_cpus_per_worker to {_number(most)}"] if most > _EPS else []
            fixes += [f"lower {name}.world_size to {placed}"] if placed else []
            raise PlacementError(
                f"{_too_small(shape, demand, nodes or [])}. A {name} worker needs {_number(cpus)} CPU beside the "
                f"device slots and no node has that much left (the most is {_number(most)} CPU). Fix: "
                + _either([*fixes, *_grid_fixes(shape), "add nodes or CPUs"])
            )
        room[index] -= cpus
        extra_cpus[index] += cpus
        assigned[name, rank] = index
    plan_nodes = []
    for index, host in enumerate(hosts):
        device_node = index < shape.num_nodes
        bundle = dict(slots) if device_node else {}
        if extra_cpus[index]:
            bundle["CPU"] = bundle.get("CPU", 0.0) + extra_cpus[index]
        slots_here = shape.devices_per_node if device_node else 0
        plan_nodes.append(PlannedNode(index=index, bundle=bundle, device_slots=slots_here, host=host))
    planned = {
        name: ranks if not ranks or ranks[0].devices else _on_nodes(ranks, [assigned[name, r.rank] for r in ranks])
        for name, ranks in demand.items()
    }
    return PlacementPlan(shape, tuple(plan_nodes), planned, None if nodes is None else tuple(nodes))


def _demand(shape: ClusterShape, roles: Mapping[str, WorkerConfig]) -> dict[str, tuple[RankPlacement, ...]]:
    """Every role's ranks: those with devices placed on the grid, device-less ones not yet on a node (-1)."""
    demand: dict[str, tuple[RankPlacement, ...]] = {}
    for name, role in roles.items():
        if role.devices:
            demand[name] = tuple(rank_placements(name, role.devices, role.num_devices_per_worker, shape))
        else:
            cpus = float(role.num_cpus_per_worker)
            demand[name] = tuple(RankPlacement(rank=r, node=-1, cpus=cpus) for r in range(role.world_size or 1))
    return demand


def _on_nodes(ranks: Sequence[RankPlacement], nodes: Sequence[int]) -> tuple[RankPlacement, ...]:
    """Device-less ranks put on `nodes`, with their local ranks counted per node."""
    per_node: Counter[int] = Counter()
    placed = []
    for r, node in zip(ranks, nodes, strict=True):
        placed.append(RankPlacement(rank=r.rank, node=node, local_rank=per_node[node], cpus=r.cpus))
        per_node[node] += 1
    return tuple(replace(r, local_world_size=per_node[r.node]) for r in placed)


def _device_hosts(
    shape: ClusterShape, demand: Mapping[str, tuple[RankPlacement, ...]], nodes: Sequence[NodeResources]
) -> tuple[list[NodeResources | None], list[NodeResources]]:
    """`num_nodes` nodes with room for a node's device slots (most CPUs first) and the other nodes (likewise)."""
    slots = shape.slot_bundle()
    by_cpus = sorted(nodes, key=lambda node: -node.get("CPU"))
    fitting = [node for node in by_cpus if all(node.get(k) + _EPS >= v for k, v in slots.items())]
    if len(fitting) < shape.num_nodes:
        what = " and ".join(f"{_number(v)} {k}" for k, v in slots.items())
        fewer = [f"lower num_nodes to {len(fitting)} (with device mappings that fit)"] if fitting else []
        raise PlacementError(
            f"{_too_small(shape, demand, nodes)}. Only {len(fitting)} of the {_count(len(nodes), 'node')} can hold "
            f"one node's device slots ({what}). Fix: "
            + _either([*_grid_fixes(shape), *fewer, f"add nodes with {what} or more"])
        )
    hosts: list[NodeResources | None] = list(fitting[: shape.num_nodes])
    spares = [node for node in by_cpus if all(node is not host for host in hosts)]
    return hosts, spares


def _too_small(
    shape: ClusterShape, demand: Mapping[str, tuple[RankPlacement, ...]], nodes: Sequence[NodeResources]
) -> str:
    """The start of a PlacementError: what the run asks for and what the cluster has."""
    asked = PlacementPlan(shape, (), dict(demand)).describe_demand()
    has = PlacementPlan(shape, (), {}, tuple(nodes)).describe_cluster()
    return f"the Ray cluster is too small for this run: {asked}; {has}"


def _grid_fixes(shape: ClusterShape) -> list[str]:
    """The device-grid overrides that would shrink the slots (each only when it can go lower)."""
    fixes = ["lower cpus_per_device"] if shape.cpus_per_device > 1 else []
    return fixes + (["lower devices_per_node (with device mappings that fit)"] if shape.devices_per_node > 1 else [])


def _either(fixes: Sequence[str]) -> str:
    return fixes[0] if len(fixes) == 1 else f"{', '.join(fixes[:-1])} or {fixes[-1]}"


def _nodes_text(ranks: Sequence[RankPlacement]) -> str:
    nodes = sorted({r.node for r in ranks})
    if nodes == [-1]:
        return "any node"
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {', '.join(map(str, nodes))}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
