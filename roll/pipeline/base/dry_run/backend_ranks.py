"""What one rank of each kind of backend holds, resident and phase by phase.

A DeepSpeed training rank: its ZeRO model states and buckets, then a micro-batch's activations and
logits, the optimizer step, a log-prob forward and (stage 0) the gradient all-reduce. An inference rank
(DeepSpeed, HF): its parameters, a log-prob forward and hf generate's KV cache and prefill. A vLLM or
SGLang engine rank: its weights and the KV cache space it is configured to claim (`ENGINE_DEFAULTS`),
beside what the tokens in flight need. Each builds on `model_states`, `activations` and `model_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roll.configs.model_dir import DTYPE_BYTES
from roll.configs.worker_config import WorkerConfig
from roll.distributed.strategy.cpu_kv_cache import cpu_kv_cache_bytes
from roll.pipeline.base.dry_run.activations import (
    activation_bytes,
    kv_cache_bytes,
    layer_activation_bytes,
    logits_bytes,
)
from roll.pipeline.base.dry_run.model_shape import ModelShape, lora_params
from roll.pipeline.base.dry_run.model_states import (
    _DS_ALLREDUCE_CHUNK,
    _DS_REDUCE_BUCKET,
    GiB,
    MemoryItem,
    Place,
    _gathered,
    _share,
    _tensor_parallel_share,
    _zero_block,
    optimizer_step_bytes,
    torch_adamw_step_bytes,
    zero_model_states,
)

# The defaults of the engine configs (VllmConfig, SglangConfig: their modules import torch; a test keeps them equal).
ENGINE_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.6,
    "kv_cache_space_gb": None,
    "mem_fraction_static": 0.6,
}


@dataclass(frozen=True)
class _Lengths:
    prompt: int
    response: int
    prompts: int | None

    @property
    def sequence(self) -> int:
        return self.prompt + self.response

    def prompts_per_rank(self, role: WorkerConfig) -> int:
        return _share(self.prompts, role.dp_size) if self.prompts else role.infer_batch_size


# What one rank holds: its resident items, the items each phase adds, and notes on how they were counted.
RankBreakdown = tuple[tuple[MemoryItem, ...], dict[str, tuple[MemoryItem, ...]], tuple[str, ...]]


def _model_params(role: WorkerConfig, shape: ModelShape, kind: str) -> tuple[int, int]:
    """(all parameters, trainable parameters) of the role's model, LoRA adapters included; a frozen vision tower
    (`model_args.freeze_vision_tower`) has no gradients nor optimizer states."""
    params = shape.param_count(kind)
    args = role.model_args
    if args.lora_rank <= 0:
        return params, params - (shape.vision_params if args.freeze_vision_tower else 0)
    trainable = lora_params(shape, args.lora_rank, list(args.lora_target_modules), kind)
    return params + trainable, trainable


def _micro_batch_rows(role: WorkerConfig, rows: int, sequence: int) -> int:
    """Full-width rows of the role's largest micro-batch: `rows`, or under a token budget (`max_tokens_per_microbatch`,
    which groups any number of rows) as many as its tokens hold at `sequence` tokens each. A packed row's attention
    over its whole budget is not counted apart."""
    budget = role.max_tokens_per_microbatch
    return rows if budget is None else max(1, budget // sequence)


def _forward_phase(role: WorkerConfig, shape: ModelShape, kind: str, lengths: _Lengths) -> tuple[MemoryItem, ...]:
    """A log-prob forward of `infer_batch_size` rows (or a token budget's) without gradients: one layer's working
    set and the logits."""
    dtype, rows = role.model_args.dtype, _micro_batch_rows(role, role.infer_batch_size, lengths.sequence)
    fused = role.model_args.attn_implementation != "eager"
    layer = layer_activation_bytes(shape, rows, lengths.sequence, dtype, fused_attention=fused)
    logits = logits_bytes(shape, rows, lengths.sequence, lengths.response, dtype, training=False, kind=kind)
    return MemoryItem("one layer", layer), MemoryItem("logits", logits)


def _generation_phase(role: WorkerConfig, shape: ModelShape, lengths: _Lengths) -> tuple[MemoryItem, ...]:
    """hf generate of up to `infer_batch_size` prompts x `num_return_sequences`: their KV cache and the prefill."""
    args, dtype = role.generating_args, role.model_args.dtype
    prompts = min(role.infer_batch_size, lengths.prompts_per_rank(role))
    sequences = prompts * args.num_return_sequences
    kv = kv_cache_bytes(shape, sequences * (lengths.prompt + args.max_new_tokens), dtype)
    fused = role.model_args.attn_implementation != "eager"
    prefill = layer_activation_bytes(shape, sequences, lengths.prompt, dtype, fused_attention=fused)
    return MemoryItem("KV cache", kv), MemoryItem("prefill layer", prefill)


def _fsdp2_as_zero3(role: WorkerConfig, shape: ModelShape) -> tuple[int, str, str, dict[str, Any]]:
    """An FSDP2 role's layout in `_zero_block`'s terms: everything sharded as at ZeRO-3, one decoder layer
    gathered while the next is prefetched (the whole model between forward and backward without
    `reshard_after_forward`), a layer's gradients reduce-scattered at a time."""
    block = role.strategy_args.strategy_config or {}
    offload = "cpu" if block.get("cpu_offload") else "none"
    layer = shape.layer_params()
    kept = 0 if block.get("reshard_after_forward", True) else shape.param_count("causal_lm")
    zero = {
        "stage3_prefetch_bucket_size": layer,
        "stage3_max_live_parameters": kept,
        "stage3_max_reuse_distance": kept,
        "reduce_bucket_size": layer,
    }
    return 3, offload, offload, zero


def reduce_buckets(zero: dict[str, Any], stage: int, trainable: int, dtype: str, platform: str) -> MemoryItem:
    """The gradient reduce buckets of a ZeRO `stage` rank with `trainable` parameters, by its zero_optimization block.

    Stages 1-2 double-buffer their reduce bucket for overlap_comm; stage 3 keeps one. A GPU allocates the buckets
    in full; on CPU only the pages the gradients passing through them fill are touched (docs/zero_memory.md).
    """
    count = 2 if zero.get("overlap_comm") and stage in (1, 2) else 1
    elements = count * int(zero.get("reduce_bucket_size", _DS_REDUCE_BUCKET))
    return MemoryItem("buckets", DTYPE_BYTES[dtype] * (min(elements, trainable) if platform == "cpu" else elements))


def _train_rank(role: WorkerConfig, shape: ModelShape, kind: str, lengths: _Lengths, platform: str) -> RankBreakdown:
    fsdp2 = role.strategy_args.strategy_name == "fsdp2_train"
    stage, offload_optimizer, offload_params, zero = _fsdp2_as_zero3(role, shape) if fsdp2 else _zero_block(role)
    dtype, args, ranks = role.model_args.dtype, role.training_args, role.dp_size
    params, trainable = _model_params(role, shape, kind)
    tp_size = role.model_parallel_size
    notes: tuple[str, ...] = (
        (
            "fsdp2_train counted as ZeRO-3 with a layer gathered and the next prefetched, its fp32 shards stepped by "
            "torch's AdamW (docs/memory_estimate.md compares a 0.36B run)",
        )
        if fsdp2
        else ()
    )
    if tp_size > 1:
        params = trainable = _tensor_parallel_share(shape, params, tp_size)
        notes = (
            f"{role.world_size} ranks = {ranks} data-parallel x {tp_size} tensor-parallel: ZeRO shards over the "
            f"{ranks}, the decoder's linear weights are split over the {tp_size}; activations counted unsplit",
        )
    resident = list(
        zero_model_states(
            stage,
            params,
            ranks,
            trainable=trainable,
            # fsdp2_train keeps every shard in fp32 (frozen LoRA bases too) and computes in `dtype`: no second copy.
            dtype="fp32" if fsdp2 else dtype,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
        )
    )
    buckets = reduce_buckets(zero, stage, trainable, dtype, platform)
    fused = role.model_args.attn_implementation != "eager"
    # A budget groups at most an optimizer step's rows.
    step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
    micro = min(step_rows, _micro_batch_rows(role, args.per_device_train_batch_size, lengths.sequence))
    train = [
        MemoryItem(
            "activations",
            activation_bytes(
                shape, micro, lengths.sequence, dtype, checkpointing=args.gradient_checkpointing, fused_attention=fused
            ),
        ),
        MemoryItem(
            "logits",
            logits_bytes(shape, micro, lengths.sequence, lengths.response, dtype, training=True, kind=kind),
        ),
    ]
    forward = list(_forward_phase(role, shape, kind, lengths))
    if stage == 3:
        resident.append(buckets)  # stage 3 keeps its reduce bucket for the life of the engine
        train.append(_gathered(shape, dtype, params, zero, training=True))
        forward.append(_gathered(shape, dtype, params, zero, training=False))
    elif stage in (1, 2):
        train.append(buckets)
    if fsdp2:  # torch's AdamW on fp32 shards, on the host with CPU offload
        foreach = platform != "cpu" and offload_optimizer == "none"
        step = torch_adamw_step_bytes(_share(trainable, ranks), _share(shape.largest_param(), ranks), foreach)
    else:
        step = optimizer_step_bytes(
            stage,
            trainable,
            ranks,
            dtype=dtype,
            offload_optimizer=offload_optimizer,
            fused_optimizer=platform == "cuda",
            largest_param=shape.largest_param(),
        )
    phases = {"train micro-batch": tuple(train), "optimizer step": step, "log-prob forward": tuple(forward)}
    if stage == 0 and ranks > 1:
        flat = DTYPE_BYTES[dtype] * min(trainable, _DS_ALLREDUCE_CHUNK)
        phases["gradient all-reduce"] = (MemoryItem("flattened grads", flat),)
    return tuple(resident), phases, notes


def _infer_rank(role: WorkerConfig, shape: ModelShape, kind: str, lengths: _Lengths) -> RankBreakdown:
    params, _ = _model_params(role, shape, kind)
    dtype = role.model_args.dtype
    forward = list(_forward_phase(role, shape, kind, lengths))
    generation = list(_generation_phase(role, shape, lengths))
    fsdp2 = role.strategy_args.strategy_name == "fsdp2_infer"
    stage, _, offload_params, zero = _fsdp2_as_zero3(role, shape) if fsdp2 else _zero_block(role)
    notes = ("fsdp2_infer counted as ZeRO-3 inference (not yet checked against a run)",) if fsdp2 else ()
    if role.strategy_args.strategy_name in ("deepspeed_infer", "fsdp2_infer") and stage == 3:
        place: Place = {"cpu": "host", "nvme": "nvme"}.get(offload_params, "device")
        resident = (MemoryItem("params", DTYPE_BYTES[dtype] * _share(params, role.dp_size), place),)
        forward.append(_gathered(shape, dtype, params, zero, training=False))
        generation.append(_gathered(shape, dtype, params, zero, training=False))
    else:
        resident = (MemoryItem("params", DTYPE_BYTES[dtype] * params),)
    return resident, {"log-prob forward": tuple(forward), "generation": tuple(generation)}, notes


def _engine_rank(
    role: WorkerConfig, shape: ModelShape, kind: str, lengths: _Lengths, platform: str, budget: int | None
) -> RankBreakdown:
    """Weights and KV cache of a vLLM/SGLang engine: the space it is configured to claim, beside what is needed."""
    config = {**ENGINE_DEFAULTS, **(role.strategy_args.strategy_config or {})}
    dtype, args = role.model_args.dtype, role.generating_args
    weights = DTYPE_BYTES[dtype] * shape.param_count(kind)
    sequences = lengths.prompts_per_rank(role) * args.num_return_sequences
    tokens = sequences * (lengths.prompt + args.max_new_tokens)
    needed = kv_cache_bytes(shape, tokens, dtype)
    fraction_key = "gpu_memory_utilization" if role.strategy_args.strategy_name == "vllm" else "mem_fraction_static"
    notes = []
    if platform == "cpu" and fraction_key == "gpu_memory_utilization":
        set_gb, longest = config["kv_cache_space_gb"], config.get("max_model_len") or shape.facts.max_positions
        space = cpu_kv_cache_bytes(set_gb, shape.facts.kv_bytes_per_token(dtype), longest)
        where = f"kv_cache_space_gb={'null' if set_gb is None else set_gb}"
    elif platform != "cpu" and budget is not None:
        # The engine claims this fraction of its devices up front and fills what the weights leave with KV cache.
        claimed = int(config[fraction_key] * budget)
        space, where = max(claimed - weights, 0), f"{fraction_key}={config[fraction_key]}"
        if weights >= claimed:
            notes.append(f"the weights ({weights / GiB:.2f} GiB) leave no KV cache in {where}: raise it")
    else:
        space, where = needed, "the tokens in flight"
    if needed > space and space:
        notes.append(
            f"{tokens} tokens in flight ({sequences} sequences x {lengths.prompt + args.max_new_tokens}) need "
            f"{needed / GiB:.2f} GiB of KV cache, more than the {space / GiB:.2f} GiB of {where}: "
            "the engine queues the rest"
        )
    return (MemoryItem("weights", weights), MemoryItem(f"KV cache ({where})", space)), {}, tuple(notes)
