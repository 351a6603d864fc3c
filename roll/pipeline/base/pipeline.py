"""What every pipeline does before its own loop: connect to Ray, reserve devices, start roles."""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import ray

from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.actor_exit import end_actors
from roll.distributed.executor.cluster import Cluster, start_hosts
from roll.distributed.executor.worker_host import process_groups
from roll.distributed.scheduler.initialize import init_ray
from roll.distributed.scheduler.placement import plan_placement
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.pipeline.base.pipeline_config import PipelineConfig
from roll.pipeline.base.preemption import StopSignals
from roll.pipeline.base.residency import Residency
from roll.platforms import PLATFORM_ENV, get_platform
from roll.utils.startup_gc import end_startup


class BasePipeline(ABC):
    """Owns the Ray connection, the device reservation and the role clusters of one run."""

    residency: Residency  # set by start_roles

    def __init__(self, config: PipelineConfig) -> None:
        end_startup()  # the driver's imports and config are done (roll/utils/startup_gc.py)
        self.config = config
        self.platform = get_platform(config.platform)
        os.environ[PLATFORM_ENV] = self.platform.name
        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        if config.num_nodes > 1 and not address:
            raise ConfigError(
                f"num_nodes={config.num_nodes} needs an existing Ray cluster: set ray_address=<head>:6379 "
                "or RAY_ADDRESS (an embedded Ray has one node)"
            )
        # An embedded Ray is one node sized for the whole plan: device slots and device-less workers.
        embedded_cpus = math.ceil(plan_placement(config.cluster_shape(), config.roles()).total_cpus)
        init_ray(address, config.ray_namespace, embedded_cpus, self.platform.name)
        # Every role's actors are reserved before any starts: a cluster too small, or a reservation Ray does
        # not grant within placement_timeout_s, is a PlacementError naming what each role asks for.
        self.resource_manager = ResourceManager(
            self.platform,
            config.num_nodes,
            config.devices_per_node or 1,
            config.cpus_per_device,
            timeout_s=config.placement_timeout_s,
            roles=config.roles(),
        )
        self.clusters: dict[str, Cluster] = {}
        self.hosts: list[ray.actor.ActorHandle] = []  # processes shared by roles (host_shared_roles)
        # Set by the entry point: the stop signals the loop checks after each step, and the restarts so far, which
        # every step's metrics carry (roll/pipeline/base/recovery.py).
        self.stop_signals: StopSignals | None = None
        self.fault_metrics: dict[str, float] = {}

    @property
    def stop_requested(self) -> bool:
        """Whether SIGTERM or SIGINT asked the run to stop at the next step boundary (with a checkpoint)."""
        return self.stop_signals is not None and self.stop_signals.requested

    def start_cluster(self, role_name: str, hosts: list[ray.actor.ActorHandle] | None = None) -> Cluster:
        """Start the workers of role `role_name` as configured (in `hosts`, one per rank, if given); remember it."""
        role = self.config.roles()[role_name]
        cluster = Cluster(role.worker_cls, role, self.resource_manager, hosts)
        self.clusters[role_name] = cluster
        return cluster

    def start_roles(self, role_names: Iterable[str]) -> None:
        """Start the roles `role_names` (those sharing devices in shared processes, `share_worker_processes`), build
        their models concurrently, then track their states in `residency`."""
        configured = self.config.roles()
        roles = {name: configured[name] for name in role_names}
        with self.released_on_failure():
            hosts = self.host_shared_roles(roles) if self.config.share_worker_processes else {}
            for name in roles:
                self.start_cluster(name, hosts.get(name))
            for future in [cluster.initialize(blocking=False) for cluster in self.clusters.values()]:
                future.get()
        self.residency = Residency.of_roles(self.clusters, self.config.roles())

    @contextmanager
    def released_on_failure(self) -> Iterator[None]:
        """Within it, a failure (a worker that cannot build its model, ...) shuts down what this pipeline started
        before it propagates: a constructor that fails returns no pipeline whose `shutdown` a caller could call, and
        on a Ray that outlives the driver (a notebook's, a test session's) its reservation would stay held."""
        try:
            yield
        except BaseException:
            self.shutdown()
            raise

    def host_shared_roles(self, roles: dict[str, WorkerConfig]) -> dict[str, list[ray.actor.ActorHandle]]:
        """A WorkerHost per rank for each group of `roles` that can share processes; each grouped role's hosts."""
        hosts_of = {}
        for group in process_groups(roles):
            hosts = start_hosts(roles[group[0]], self.resource_manager, "+".join(group))
            self.hosts.extend(hosts)
            hosts_of.update(dict.fromkeys(group, hosts))
        return hosts_of

    @classmethod
    def finished_result(cls, config: PipelineConfig) -> Any:
        """The result of a run whose work `config` says is already done (None: run it), asked before Ray starts."""
        return None

    @abstractmethod
    def run(self) -> None:
        """The pipeline's driver loop."""

    def shutdown(self, close_timeout_s: float = 60) -> None:
        """Stop every role and release the devices; workers get `close_timeout_s` to release what they started."""
        for cluster in self.clusters.values():
            cluster.shutdown(close_timeout_s)
        self.clusters.clear()
        end_actors(self.hosts)
        self.hosts.clear()
        self.resource_manager.destroy()
