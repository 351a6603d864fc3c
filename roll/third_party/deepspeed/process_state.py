"""DeepSpeed's process-wide state that outlives an engine (DeepSpeed 0.19), and how to reset it.

A process that builds one engine and exits never notices this state. A process that hosts one role after
another (roll/distributed/executor/worker_host.py) must find it as a new process has it: ZeRO-3 numbers modules
and parameters with process-wide counters, and the ranks of the next engine compare those numbers, so a rank
whose process ran one engine more than its peer's fails (or, through the persistence budget, partitions
differently); caches and the stack of modules in forward keep the last model alive; cached groups point at
destroyed process groups; AutoTP's training mode changes how its layers add biases.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The module globals in which deepspeed.utils.groups keeps the groups ZeRO and AutoTP use.
_GROUP_CACHES = (
    "_WORLD_GROUP",
    "_DATA_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
    "mesh_device",
)
# zero.Init's class-wide counters: parameter ids and the parameters kept whole (the persistence budget).
_INIT_COUNTERS = ("param_id", "num_persisted_parameters", "num_persisted_elements")


def leftovers() -> list[str]:
    """What engines left of DeepSpeed's process-wide state, one description each; empty when DeepSpeed is not loaded
    or the state is as a new process has it."""
    found = []
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        cached = [name for name in _GROUP_CACHES if getattr(groups, name, None) is not None]
        found += [f"DeepSpeed still caches the process group {name}" for name in cached]
    layers = sys.modules.get("deepspeed.module_inject.layers")
    if layers is not None and layers.is_autotp_training_mode():
        found.append("DeepSpeed's AutoTP is still in training mode")
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        if offload.FWD_MODULE_STACK:
            found.append(f"ZeRO-3's stack of modules in forward still holds {len(offload.FWD_MODULE_STACK)}")
        counted = _module_counter(offload)[0]
        if counted:
            found.append(f"ZeRO-3's module counter is at {counted}, not 0")
    partition = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if partition is not None:
        counters = {name: getattr(partition.Init, name) for name in _INIT_COUNTERS}
        if any(counters.values()):
            found.append(f"zero.Init's counters are not reset: {counters}")
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None and _release_cache(coordinator).cache_info().currsize:
        found.append("ZeRO-3's cache of the parameters each submodule releases is not empty")
    return found


def reset_after_engine(module: torch.nn.Module) -> None:
    """Reset DeepSpeed's process-wide state after the engine of `module` was destroyed and its process group left
    (`deepspeed.comm.destroy_process_group` clears the cached groups): the stack of modules in forward (a ZeRO-3
    engine pushes its model there and never pops it), the class-wide cache of parameters to release (an lru_cache
    keyed by coordinator and submodule), the module and parameter counters, AutoTP's mode.

    No other engine may live in the process: its numbering and caches would be reset under it.
    """
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        offload.FWD_MODULE_STACK[:] = [entry for entry in offload.FWD_MODULE_STACK if entry is not module]
        _module_counter(offload)[0] = 0
    partition = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if partition is not None:
        for name in _INIT_COUNTERS:
            setattr(partition.Init, name, 0)
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None:
        _release_cache(coordinator).cache_clear()
    layers = sys.modules.get("deepspeed.module_inject.layers")
    if layers is not None:
        layers.set_autotp_mode(training=False)


def _module_counter(offload: Any) -> list[int]:
    """The counter ZeRO-3 numbers modules with: `_register_deepspeed_module`'s mutable default `count=[0]`."""
    return offload.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0]


def _release_cache(coordinator: Any) -> Any:
    """The lru_cache behind `PartitionedParameterCoordinator.__params_to_release`, inside DeepSpeed's NVTX wrapper
    (which keeps no `__wrapped__`: it is reached by the wrapper's closure)."""
    wrapper = vars(coordinator.PartitionedParameterCoordinator)["_PartitionedParameterCoordinator__params_to_release"]
    return next(cell.cell_contents for cell in wrapper.__closure__ if hasattr(cell.cell_contents, "cache_clear"))
