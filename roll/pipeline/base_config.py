"""The pipeline base config: cluster shape, Ray connection, output, and the roles it declares."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.distributed.strategy.registry import check_strategy_args


@dataclass
class PipelineConfig:
    """Fields every pipeline shares. Subclasses add their roles as `WorkerConfig` fields.

    A *device* is a GPU (or NPU) on accelerator nodes and a slot of `cpus_per_device` cores on CPU
    nodes; `devices_per_node` defaults to what this machine has (its GPUs, or its cores divided
    into slots).
    """

    exp_name: str = "roll"
    seed: int = 42
    output_dir: str = "./output"
    platform: Literal["auto", "cpu", "cuda", "rocm", "npu"] = "auto"
    num_nodes: int = 1
    devices_per_node: int | None = None
    cpus_per_device: int = 1
    ray_address: str | None = None
    ray_namespace: str = "roll"

    @property
    def total_devices(self) -> int:
        """Devices in the whole cluster (valid after `validate`)."""
        return self.num_nodes * (self.devices_per_node or 0)

    def roles(self) -> dict[str, WorkerConfig]:
        """The configured roles by name, in declaration order (roles set to null are left out).

        A mapping of roles (such as `rewards: {math: ..., code: ...}`) gives one role per entry,
        named `rewards.math`.
        """
        roles: dict[str, WorkerConfig] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, WorkerConfig):
                roles[f.name] = value
            elif isinstance(value, dict):
                roles.update({f"{f.name}.{k}": v for k, v in value.items() if isinstance(v, WorkerConfig)})
        return roles

    def validate(self) -> None:
        """Resolve defaults that depend on the machine and check every role; raise ConfigError."""
        from roll.platforms import detect_platform

        if self.platform == "auto":
            self.platform = detect_platform().name
        if self.num_nodes < 1 or self.cpus_per_device < 1:
            raise ConfigError("num_nodes and cpus_per_device must be at least 1")
        if self.devices_per_node is None:
            self.devices_per_node = self._local_device_count()
        if self.devices_per_node < 1:
            raise ConfigError(f"devices_per_node={self.devices_per_node} must be at least 1")
        for name, role in self.roles().items():
            role.resolve(name, self.total_devices)
            self._check_worker_fits_a_node(role)
            check_strategy_args(role)

    def _local_device_count(self) -> int:
        from roll.platforms import current_platform, get_platform

        platform = current_platform() if self.platform == "auto" else get_platform(self.platform)
        if platform.is_accelerator:
            return platform.device_count()
        return max(1, (os.cpu_count() or 1) // self.cpus_per_device)

    def _check_worker_fits_a_node(self, role: WorkerConfig) -> None:
        per_worker = role.num_devices_per_worker
        for start in range(0, len(role.devices), per_worker):
            nodes = {d // self.devices_per_node for d in role.devices[start : start + per_worker]}
            if len(nodes) > 1:
                raise ConfigError(
                    f"{role.name}: worker {start // per_worker} spans nodes {sorted(nodes)}; a worker's "
                    f"{per_worker} devices must lie on one node of {self.devices_per_node} devices"
                )

    def check_divisible(self, field_name: str, value: int, role: WorkerConfig) -> None:
        """Raise ConfigError unless batch size `value` splits evenly over `role`'s data-parallel ranks."""
        if value % role.dp_size:
            raise ConfigError(
                f"{field_name}={value} does not divide by {role.name}'s data-parallel size {role.dp_size}; "
                f"set {field_name} to a multiple of {role.dp_size} or change {role.name}.device_mapping"
            )
