"""Where DeepSpeed keeps engine states: the private fields offloading touches, listed in one place.

Offloading moves storages, not tensors, so every tensor object that views an offloaded storage must be found and
repointed. These tables name the DeepSpeed attributes that hold such tensors; `check_supported` verifies them against
the installed DeepSpeed before an engine is patched. A field missing from the tables leaves a stale view behind, which
offloading reports as `stale_bytes` (and the tests fail on).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from roll.third_party.deepspeed.storage_mover import StorageGroup

MIN_DEEPSPEED = (0, 16, 4)
TESTED_DEEPSPEED = (0, 19, 8)


class OffloadStateType(str, Enum):
    """The engine states that move together: `include` of `offload_states` / `reload_states` names some of them.

    `model_params`: the low-precision parameters (trainable and frozen) and the module's buffers; `other_params`:
    fp32 master parameters, gradients and gradient buckets; `optimizer_states`: e.g. Adam's exp_avg / exp_avg_sq.
    """

    model_params = "model_params"
    other_params = "other_params"
    optimizer_states = "optimizer_states"


MODEL, OTHER, OPTIM = OffloadStateType.model_params, OffloadStateType.other_params, OffloadStateType.optimizer_states

# A storage viewed from fields of several kinds belongs to the first kind here (at stage 0 in fp32 the module
# parameters are also the optimizer's master parameters: they move with model_params).
KIND_PRECEDENCE = (MODEL, OPTIM, OTHER)


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed, or this engine's configuration, is outside what offloading supports."""


@dataclass(frozen=True)
class Field:
    """A path of attributes (dict keys, `*` for every element) on a DeepSpeed object whose value holds tensors.

    `required` fields exist in every supported DeepSpeed version and are checked when an engine is patched; the
    others appear only in some versions or configurations. `scratch` buffers (gradient buckets, staging buffers) are
    rewritten before they are read, so offloading frees them and reloading reallocates them without copying.
    """

    path: str
    kind: OffloadStateType
    required: bool = False
    scratch: bool = False


# The wrapped torch optimizer; DeepSpeed's DummyOptim (engines without an optimizer) has no `state`.
_INNER_OPTIMIZER = (
    Field("optimizer.state.*", OPTIM),
    Field("optimizer.param_groups.*.params", OTHER, required=True),
)

# Keyed by class name and matched along the optimizer's MRO, so subclasses (e.g. ZenFlow's) are covered too.
OPTIMIZER_FIELDS: dict[str, tuple[Field, ...]] = {
    # ZeRO-1/2: runtime/zero/stage_1_and_2.py
    "DeepSpeedZeroOptimizer": (
        *_INNER_OPTIMIZER,
        Field("bit16_groups_flat", MODEL, required=True),
        Field("parallel_partitioned_bit16_groups", MODEL, required=True),
        Field("single_partition_of_fp32_groups", OTHER, required=True),
        Field("averaged_gradients", OTHER, required=True),
        Field("grads_in_partition", OTHER),
        Field("accumulated_grads_in_cpu", OTHER),
        Field("offload_gradient_dict", OTHER),
        Field("ipg_buffer", OTHER, scratch=True),  # as in DeepSpeed 0.16
        Field("ipg_buckets.*.buffer", OTHER, scratch=True),  # as in DeepSpeed 0.19
        Field("ipg_buckets.*.grads", OTHER, scratch=True),
        Field("temp_grad_buffer_for_cpu_offload", OTHER, scratch=True),
        Field("temp_grad_buffer_for_gpu_offload", OTHER, scratch=True),
        Field("param_buffer_of_bit16_for_cpu_offload_groups", OTHER, scratch=True),
    ),
    # ZeRO-3 with an optimizer: runtime/zero/stage3.py
    "DeepSpeedZeroOptimizer_Stage3": (
        *_INNER_OPTIMIZER,
        Field("fp16_partitioned_groups", MODEL, required=True),
        Field("fp16_partitioned_groups_flat", MODEL, required=True),
        Field("lp_param_buffer", MODEL),
        Field("param_groups_fp16_flat_cpu_memory", MODEL),
        Field("fp32_partitioned_groups_flat", OTHER, required=True),
        Field("grad_partitions_flat_buffer", OTHER, required=True),
        Field("_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", OTHER, required=True),
        Field("averaged_gradients", OTHER, required=True),
        Field("_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer", OTHER, scratch=True),  # as in DeepSpeed 0.16
        Field("ipg_buckets.*.buffer", OTHER, scratch=True),  # as in DeepSpeed 0.19
    ),
    # ZeRO-3 without an optimizer (deepspeed_infer): only the module's parameters, partitioned.
    "DeepSpeedZeRoOffload": (),
    # bf16 with fp32 gradient accumulation (stage 0/1) and bf16 engines without an optimizer: runtime/bf16_optimizer.py
    "BF16_Optimizer": (
        *_INNER_OPTIMIZER,
        Field("bf16_groups_flat", MODEL, required=True),
        Field("bf16_partitioned_groups", MODEL, required=True),
        Field("fp32_groups_flat_partition", OTHER, required=True),
        Field("fp32_groups_gradients_flat", OTHER, required=True),
        Field("fp32_groups_gradients", OTHER),
        Field("fp32_groups_actual_gradients_flat", OTHER),
        Field("fp32_groups_gradient_flat_partition", OTHER),
        Field("non_expert_gradients", OTHER),
        Field("expert_gradients", OTHER),
    ),
    # stage 0 in fp16 / bf16: runtime/fp16/fused_optimizer.py and unfused_optimizer.py
    "FP16_Optimizer": (
        *_INNER_OPTIMIZER,
        Field("fp16_groups_flat", MODEL, required=True),
        Field("fp32_groups_flat", OTHER, required=True),
    ),
    "FP16_UnfusedOptimizer": (
        *_INNER_OPTIMIZER,
        Field("fp32_groups", OTHER, required=True),
    ),
}

# stage 0 in fp32: DeepSpeed uses the basic torch optimizer as is.
BASIC_OPTIMIZER_FIELDS = (Field("state.*", OPTIM), Field("param_groups.*.params", OTHER))

# Attributes DeepSpeed sets on module parameters: ZeRO-3 partitions, and the fragment views linking a low-precision
# parameter to its master copy and optimizer states (`_hp_mapping`, stages 1-2 and BF16_Optimizer).
PARAM_FIELDS = (
    Field("ds_tensor", MODEL),
    Field("ds_secondary_tensor", MODEL),
    Field("_hp_mapping.lp_fragment", MODEL),
    Field("_hp_mapping.hp_fragment", OTHER),
    Field("_hp_mapping.optim_fragment.*", OPTIM),
)

# ZeRO-3 keeps gathered full parameters cached after a forward; this releases them before model_params move.
RELEASE_GATHERED_PARAMS = "empty_partition_cache"


def deepspeed_version() -> tuple[int, int, int]:
    """The installed DeepSpeed version as (major, minor, patch)."""
    import deepspeed

    match = re.match(r"(\d+)\.(\d+)\.(\d+)", deepspeed.__version__)
    if match is None:
        raise UnsupportedDeepSpeedError(f"cannot parse the DeepSpeed version {deepspeed.__version__!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def optimizer_fields(optimizer: Any) -> tuple[Field, ...]:
    """The fields of `engine.optimizer` that hold states; raises for an optimizer class not in the tables."""
    if optimizer is None:
        return ()
    for cls in type(optimizer).__mro__:
        if cls.__name__ in OPTIMIZER_FIELDS:
            return OPTIMIZER_FIELDS[cls.__name__]
    if isinstance(optimizer, torch.optim.Optimizer):
        return BASIC_OPTIMIZER_FIELDS
    raise UnsupportedDeepSpeedError(
        f"offloading does not know where {type(optimizer).__name__} keeps its states; supported: "
        f"{', '.join(OPTIMIZER_FIELDS)} and plain torch optimizers"
    )


def check_supported(engine: Any) -> None:
    """Raise `UnsupportedDeepSpeedError` unless the installed DeepSpeed and this engine's optimizer can be offloaded."""
    version = deepspeed_version()
    shown = ".".join(map(str, version))
    if version < MIN_DEEPSPEED:
        raise UnsupportedDeepSpeedError(
            f"offload_states needs DeepSpeed >= {'.'.join(map(str, MIN_DEEPSPEED))}, found {shown}"
        )
    fields = optimizer_fields(engine.optimizer)
    missing = [field.path for field in fields if field.required and not _has_path(engine.optimizer, field.path)]
    if missing:
        raise UnsupportedDeepSpeedError(
            f"DeepSpeed {shown}: {type(engine.optimizer).__name__} lacks the fields offloading moves "
            f"({', '.join(missing)}); supported and tested: {'.'.join(map(str, MIN_DEEPSPEED))} to "
            f"{'.'.join(map(str, TESTED_DEEPSPEED))}"
        )
    for name in nvme_swapped_states(engine):
        raise UnsupportedDeepSpeedError(
            f"{name} to nvme is configured: DeepSpeed's own swapper owns those buffers, so they cannot be "
            "offloaded again; use offload device 'nvme' of offload_states with a device-resident engine instead"
        )


def nvme_swapped_states(engine: Any) -> list[str]:
    """The ZeRO offloads (`offload_param`, `offload_optimizer`) this engine swaps to NVMe itself (ZeRO-Infinity)."""
    swapped = []
    for name in ("offload_param", "offload_optimizer"):
        config = getattr(engine, f"zero_{name}")()
        if config is not None and getattr(config.device, "value", config.device) == "nvme":
            swapped.append(name)
    return swapped


def collect_storage_groups(engine: Any) -> dict[OffloadStateType, list[StorageGroup]]:
    """Every storage of the engine's states with all tensor objects viewing it, grouped by state kind.

    Meta tensors, empty storages (ZeRO-3's released parameters, offloaded placeholders) and tensors without a
    strided storage are skipped.
    """
    claims: dict[int, tuple[torch.Tensor, set[OffloadStateType], bool]] = {}

    def claim(value: Any, kind: OffloadStateType, scratch: bool = False) -> None:
        stack = [(tensor, kind, scratch) for tensor in _iter_tensors(value)]
        while stack:
            tensor, tensor_kind, tensor_scratch = stack.pop()
            if tensor.layout != torch.strided or tensor.device.type == "meta":
                continue
            if id(tensor) in claims:
                _, kinds, was_scratch = claims[id(tensor)]
                kinds.add(tensor_kind)
                claims[id(tensor)] = (tensor, kinds, was_scratch and tensor_scratch)
                continue
            claims[id(tensor)] = (tensor, {tensor_kind}, tensor_scratch)
            if tensor._base is not None:
                stack.append((tensor._base, tensor_kind, tensor_scratch))
            if tensor.is_leaf and tensor.grad is not None:
                stack.append((tensor.grad, OTHER, False))

    module = engine.module
    for param in module.parameters():
        claim(param, MODEL)
        for field in PARAM_FIELDS:
            claim(_resolve(param, field.path), field.kind)
    for buffer in module.buffers():
        claim(buffer, MODEL)
    for field in optimizer_fields(engine.optimizer):
        claim(_resolve(engine.optimizer, field.path), field.kind, field.scratch)

    groups: dict[tuple[str, int], StorageGroup] = {}
    owners: dict[tuple[str, int], set[OffloadStateType]] = {}
    for tensor, kinds, scratch in claims.values():
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = (str(tensor.device), storage.data_ptr())
        if key not in groups:
            groups[key] = StorageGroup(storage, [], scratch)
            owners[key] = set()
        group = groups[key]
        group.tensors.append(tensor)
        group.scratch = group.scratch and scratch
        owners[key] |= kinds

    by_kind: dict[OffloadStateType, list[StorageGroup]] = {kind: [] for kind in OffloadStateType}
    for key, group in groups.items():
        by_kind[next(kind for kind in KIND_PRECEDENCE if kind in owners[key])].append(group)
    return by_kind


def _iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in `value`, descending into lists, tuples, sets and dict values."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)


def _resolve(obj: Any, path: str) -> list[Any]:
    """The values at `path` under `obj`; a missing attribute or key yields nothing."""
    values = [obj]
    for part in path.split("."):
        following: list[Any] = []
        for value in values:
            if value is None:
                continue
            if part == "*":
                following.extend(value.values() if isinstance(value, dict) else value)
            elif isinstance(value, dict):
                if part in value:
                    following.append(value[part])
            elif hasattr(value, part):
                following.append(getattr(value, part))
        values = following
    return values


def _has_path(obj: Any, path: str) -> bool:
    """Whether the named attributes of `path` exist (`*` segments and what follows them are not checked)."""
    for part in path.split("."):
        if part == "*":
            return True
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True
