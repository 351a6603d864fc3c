"""What DeepSpeed keeps of a model on one rank: ZeRO's model states and the optimizer step's working set.

Model states are the ZeRO paper's formulas for mixed-precision Adam as DeepSpeed 0.19 keeps them, which
docs/zero_memory.md measures to the byte; the optimizer step's working set follows what docs/zero_memory.md
measured of DeepSpeed and torch AdamW. Also here: `MemoryItem` (bytes of one kind, and where they live),
which a rank's estimate lists, and what a role's `zero_optimization` block and tensor parallelism make of
its parameters (those ZeRO-3 holds gathered, the share of a tensor-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from roll.configs.model_dir import DTYPE_BYTES
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.dry_run.model_shape import ModelShape

Place = Literal["device", "host", "nvme"]
GiB = 2**30
FP32 = 4
# DeepSpeed's defaults for the bucket sizes, in elements.
_DS_REDUCE_BUCKET = 500_000_000
_DS_PREFETCH_BUCKET = 50_000_000
# stage3_max_live_parameters and stage3_max_reuse_distance, and their default.
_DS_LIVE_KEYS = ("stage3_max_live_parameters", "stage3_max_reuse_distance")
_DS_LIVE_PARAMETERS = 1_000_000_000
# Stage 0 all-reduces gradients in chunks of at most this many elements (MEMORY_OPT_ALLREDUCE_SIZE).
_DS_ALLREDUCE_CHUNK = 500_000_000


@dataclass(frozen=True)
class MemoryItem:
    """Bytes of one kind of memory on one rank, and where they live."""

    name: str
    nbytes: int
    place: Place = "device"


def _share(count: int, ranks: int) -> int:
    return -(-count // ranks)


def zero_model_states(
    stage: int,
    params: int,
    ranks: int,
    *,
    trainable: int | None = None,
    dtype: str = "bf16",
    offload_optimizer: str = "none",
    offload_params: str = "none",
) -> tuple[MemoryItem, ...]:
    """Per-rank model states of mixed-precision Adam at ZeRO `stage` (Rajbhandari et al., 2020, fig. 1).

    For Ψ = `params` on N = `ranks`: parameters 2Ψ in 16-bit (/N at stage 3), gradients 2Ψ (/N from
    stage 2), fp32 master weights 4Ψ and Adam moments 8Ψ (/N from stage 1); 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N
    and 16Ψ/N in all. Only `trainable` parameters (LoRA: the adapters) have gradients and optimizer
    states. In fp32 the parameters and gradients take 4 bytes and DeepSpeed keeps no separate master copy
    at stage 0 or at stage 3 on the device (stages 1-2 clone one). An offloaded optimizer ("cpu" or "nvme")
    keeps master and moments there, and its gradient partition in host memory: fp32 at stages 1-2, with a
    16-bit staging copy of the partition; 16-bit at stage 3. `offload_params` (stage 3) moves the parameter
    partition.
    """
    trainable = params if trainable is None else trainable
    width = DTYPE_BYTES[dtype]
    offloaded = offload_optimizer in ("cpu", "nvme")
    optimizer_place: Place = {"cpu": "host", "nvme": "nvme"}.get(offload_optimizer, "device")
    optimizer_share = _share(trainable, ranks) if stage >= 1 else trainable
    params_place: Place = {"cpu": "host", "nvme": "nvme"}.get(offload_params, "device") if stage == 3 else "device"
    items = [MemoryItem("params", width * (_share(params, ranks) if stage == 3 else params), params_place)]
    if offloaded and stage in (1, 2):
        items.append(MemoryItem("grads", FP32 * optimizer_share, "host"))
        items.append(MemoryItem("16-bit staging", width * optimizer_share, "host"))
    else:
        grads = width * (_share(trainable, ranks) if stage >= 2 else trainable)
        items.append(MemoryItem("grads", grads, "host" if offloaded else "device"))
    if dtype != "fp32" or stage in (1, 2) or (stage == 3 and offloaded):
        items.append(MemoryItem("fp32 master", FP32 * optimizer_share, optimizer_place))
    items.append(MemoryItem("Adam m+v", 2 * FP32 * optimizer_share, optimizer_place))
    return tuple(items)


def optimizer_step_bytes(
    stage: int,
    trainable: int,
    ranks: int,
    *,
    dtype: str = "bf16",
    offload_optimizer: str = "none",
    fused_optimizer: bool = False,
    largest_param: int = 0,
) -> tuple[MemoryItem, ...]:
    """What DeepSpeed's optimizer step holds beyond the model states, at its largest (docs/zero_memory.md).

    An fp32 copy of the gradients (at stage 0 of all of them when training in 16-bit; from stage 1 of
    the rank's partition), and torch AdamW's two temporaries the size of the tensor it steps: the flat
    fp32 partition from stage 1, one parameter at stage 0. A fused optimizer (FusedAdam on CUDA) has no
    temporaries; an offloaded one (DeepSpeedCPUAdam) steps its host partition in place.
    """
    if offload_optimizer in ("cpu", "nvme"):
        return ()
    if stage == 0:
        copy = FP32 * trainable if dtype != "fp32" else 0
        stepped = largest_param
    else:
        copy = FP32 * _share(trainable, ranks)
        stepped = _share(trainable, ranks)
    items = [MemoryItem("fp32 grad copy", copy)] if copy else []
    if not fused_optimizer:
        items.append(MemoryItem("AdamW temporaries", 2 * FP32 * stepped))
    return tuple(items)


def torch_adamw_step_bytes(trainable_share: int, largest_share: int, foreach: bool) -> tuple[MemoryItem, ...]:
    """What torch's AdamW holds beyond the model states when it steps fp32 shards in place (fsdp2_train): no copy
    of the gradients, which are fp32 already, and two temporaries the size of what one of its steps takes: the
    rank's whole share with the multi-tensor (foreach) implementation torch picks for accelerator tensors, one
    parameter's shard at a time for host tensors."""
    return (MemoryItem("AdamW temporaries", 2 * FP32 * (trainable_share if foreach else largest_share)),)


def _zero_block(role: WorkerConfig) -> tuple[int, str, str, dict[str, Any]]:
    """ZeRO stage, optimizer and parameter offload devices, and the zero_optimization block (as deepspeed_config)."""
    zero = (role.strategy_args.strategy_config or {}).get("zero_optimization", {})
    offload = [zero.get(key, {}).get("device", "none") for key in ("offload_optimizer", "offload_param")]
    return int(zero.get("stage", 0)), offload[0], offload[1], zero


def _gathered(shape: ModelShape, dtype: str, params: int, zero: dict[str, Any], *, training: bool) -> MemoryItem:
    """Full parameters ZeRO-3 holds gathered: the module in use and those prefetched after it.

    In training, a parameter gathered in forward also stays until backward uses it again, as long as
    that is within `stage3_max_reuse_distance` parameters and `stage3_max_live_parameters` allow: with
    DeepSpeed's 1e9 for both, a model under a billion parameters stays whole through forward and backward.
    """
    largest = max(shape.layer_params(), shape.vocab_size * shape.hidden_size)
    held = largest + int(zero.get("stage3_prefetch_bucket_size", _DS_PREFETCH_BUCKET))
    if training:
        kept = min(int(zero.get(key, _DS_LIVE_PARAMETERS)) for key in _DS_LIVE_KEYS)
        held = max(held, kept)
    return MemoryItem("gathered params", DTYPE_BYTES[dtype] * min(held, params))


def _tensor_parallel_share(shape: ModelShape, params: int, tp_size: int) -> int:
    """Parameters on one rank when the decoder layers' linear weights are split over `tp_size` ranks.

    Embeddings, norms and the output head are counted whole on every rank (an upper bound: DeepSpeed
    AutoTP also splits some heads).
    """
    linear = shape.num_layers * sum(i * o + (o if bias else 0) for i, o, bias in shape.linear_shapes().values())
    return params - linear + _share(linear, tp_size)
