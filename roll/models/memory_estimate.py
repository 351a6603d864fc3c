"""Per-rank memory of a role, estimated from its config and its model's config.json alone.

Plain arithmetic for `dry_run`: no torch, no Ray, no weights (a `tiny://` reference imports the
tiny-model module for its tokenizer's size, but builds nothing). What each part rests on:

- parameter counts are exact for the dense decoders it knows (llama, mistral, qwen2, qwen3 layouts);
- model states are the ZeRO paper's formulas for mixed-precision Adam as DeepSpeed 0.19 keeps them,
  which docs/zero_memory.md measures to the byte;
- the optimizer step's working set follows what docs/zero_memory.md measured of DeepSpeed and torch AdamW;
- activations are an **estimate**: Korthikanti et al.'s (2022) count of what each op saves for backward,
  redone for Llama/Qwen layers (fp32 RMSNorm inputs, a gated MLP; the s² attention term only for eager
  attention, since fused kernels keep no attention matrix);
- a KV cache is 2 × layers × kv_heads × head_dim × tokens × dtype bytes.

docs/memory_estimate.md compares the estimate with a real DeepSpeed run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from roll.configs.model_dir import DTYPE_BYTES, ModelFacts
from roll.configs.worker_config import WorkerConfig

Place = Literal["device", "host", "nvme"]
GiB = 2**30
FP32 = 4
# The defaults of the engine configs (VllmConfig, SglangConfig: a layer above this one; a test keeps them equal).
ENGINE_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.6,
    "kv_cache_space_gb": 1,
    "mem_fraction_static": 0.6,
}
# What each backend holds; a test checks that every registered strategy is here.
STRATEGY_KINDS = {
    "deepspeed_train": "train",
    "deepspeed_infer": "infer",
    "hf_infer": "infer",
    "vllm": "engine",
    "sglang": "engine",
}
# DeepSpeed's defaults for the bucket sizes, in elements.
_DS_REDUCE_BUCKET = 500_000_000
_DS_PREFETCH_BUCKET = 50_000_000
# stage3_max_live_parameters and stage3_max_reuse_distance, and their default.
_DS_LIVE_KEYS = ("stage3_max_live_parameters", "stage3_max_reuse_distance")
_DS_LIVE_PARAMETERS = 1_000_000_000
# Stage 0 all-reduces gradients in chunks of at most this many elements (MEMORY_OPT_ALLREDUCE_SIZE).
_DS_ALLREDUCE_CHUNK = 500_000_000
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder-only transformer that fix its parameter count and its memory."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_positions: int | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """The shape a Hugging Face config.json describes; ValueError for what it cannot count (MoE, missing sizes)."""
        merged = {**config, **(config.get("text_config") or {})}  # multimodal configs nest the language model
        model_type = merged.get("model_type", "")
        if any(merged.get(key) for key in _MOE_KEYS):
            raise ValueError(f"model_type={model_type!r} is a mixture of experts; only dense decoders are estimated")
        try:
            hidden, heads = merged["hidden_size"], merged["num_attention_heads"]
            shape = {
                "vocab_size": merged["vocab_size"],
                "num_layers": merged["num_hidden_layers"],
                "intermediate_size": merged["intermediate_size"],
            }
        except KeyError as exc:
            raise ValueError(f"model_type={model_type!r}: config has no {exc.args[0]}") from exc
        attention_bias = bool(merged.get("attention_bias", False))
        qwen2 = model_type == "qwen2"  # Qwen2 has q/k/v biases whatever the config says, and no o_proj bias
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=merged.get("num_key_value_heads") or heads,
            head_dim=merged.get("head_dim") or hidden // heads,
            tie_word_embeddings=bool(merged.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(merged.get("mlp_bias", False)),
            qk_norm=model_type.startswith("qwen3"),
            max_positions=merged.get("max_position_embeddings"),
            **shape,
        )

    def linear_shapes(self) -> dict[str, tuple[int, int, bool]]:
        """Each decoder layer's linear modules by name: (in features, out features, has a bias)."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (hidden, q_width, self.qkv_bias),
            "k_proj": (hidden, kv_width, self.qkv_bias),
            "v_proj": (hidden, kv_width, self.qkv_bias),
            "o_proj": (q_width, hidden, self.o_bias),
            "gate_proj": (hidden, inter, self.mlp_bias),
            "up_proj": (hidden, inter, self.mlp_bias),
            "down_proj": (inter, hidden, self.mlp_bias),
        }

    def layer_params(self) -> int:
        """Parameters of one decoder layer: its linear modules and RMSNorms (and q/k norms at Qwen3)."""
        linear = sum(i * o + (o if bias else 0) for i, o, bias in self.linear_shapes().values())
        return linear + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def head_params(self, kind: str = "causal_lm") -> int:
        """Parameters of the output head roll loads for `kind`: the LM head (none when tied to the embeddings),
        or the one-output `score` head of a `value` (with a bias) or `reward` model."""
        heads = {
            "causal_lm": 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size,
            "value": self.hidden_size + 1,
            "reward": self.hidden_size,
        }
        if kind not in heads:
            raise ValueError(f"model kind {kind!r} is not one of {', '.join(heads)}")
        return heads[kind]

    def param_count(self, kind: str = "causal_lm") -> int:
        """All parameters of the model as roll loads it: `causal_lm`, `value` (one value per token) or `reward`."""
        embeddings = self.vocab_size * self.hidden_size
        return embeddings + self.num_layers * self.layer_params() + self.hidden_size + self.head_params(kind)

    def largest_param(self) -> int:
        """Elements of the largest single weight (embeddings or an MLP matrix)."""
        return max(self.vocab_size * self.hidden_size, *(i * o for i, o, _ in self.linear_shapes().values()))

    def output_width(self, kind: str) -> int:
        """Outputs per token of the model's head: the vocabulary, or one score."""
        return self.vocab_size if kind == "causal_lm" else 1

    @property
    def facts(self) -> ModelFacts:
        """The sizes config validation reads (positions, layers, KV width)."""
        return ModelFacts(self.max_positions, self.num_layers, self.num_kv_heads * self.head_dim)


def model_shape(model_name_or_path: str) -> ModelShape:
    """The shape of a local model directory (its config.json) or of a `tiny://` reference, which is not built."""
    # roll.models.tiny.TINY_SCHEME, spelled out: that module imports torch, which a directory does not need.
    if model_name_or_path.startswith("tiny://"):
        return tiny_shape(model_name_or_path)
    config_file = Path(model_name_or_path).expanduser() / "config.json"
    return ModelShape.from_config(json.loads(config_file.read_text()))


def tiny_shape(reference: str) -> ModelShape:
    """The shape `roll.models.tiny.resolve_model_path(reference)` would build, read from the reference alone.

    The query is parsed as `resolve_model_path` parses it (a test holds the two together).
    """
    from roll.models.tiny import TINY_SCHEME, TinyModelSpec, _config_kwargs, build_char_tokenizer

    arch, _, query = reference[len(TINY_SCHEME) :].partition("?")
    fields: dict[str, Any] = {"arch": arch or "qwen2"}
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key in TinyModelSpec.__dataclass_fields__ and key != "arch":
            fields[key] = value.lower() == "true" if key == "tie_word_embeddings" else int(value)
        elif key != "seed":
            raise ValueError(f"{reference!r}: unknown tiny-model option {key!r}")
    spec = TinyModelSpec(**fields)
    return ModelShape.from_config({"model_type": spec.arch, **_config_kwargs(spec, build_char_tokenizer())})


def lora_params(shape: ModelShape, rank: int, target_modules: list[str], kind: str = "causal_lm") -> int:
    """Parameters PEFT adds for LoRA of `rank` on `target_modules`: the only ones that train.

    Each adapted linear module of every layer gets rank x (in + out) parameters; value and reward
    models also train a full copy of their `score` head (PEFT's `modules_to_save`; the original stays frozen).
    """
    linears = {name: (i, o) for name, (i, o, _) in shape.linear_shapes().items()}
    if kind == "causal_lm":
        linears["lm_head"] = (shape.hidden_size, shape.vocab_size)
    matched = [name for name in linears if name in target_modules]
    if not matched:
        raise ValueError(f"LoRA target modules {target_modules} match none of {', '.join(linears)}")
    adapters = sum(rank * sum(linears[name]) * (1 if name == "lm_head" else shape.num_layers) for name in matched)
    return adapters + (0 if kind == "causal_lm" else shape.head_params(kind))


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


def layer_activation_bytes(
    shape: ModelShape, micro_batch: int, seq_len: int, dtype: str = "bf16", *, fused_attention: bool = True
) -> int:
    """Estimated bytes one decoder layer keeps for backward: what each op of a Llama/Qwen layer saves.

    Korthikanti et al.'s count (2022: s·b·h·(34 + 5·a·s/h) at 16-bit for a GPT layer with a 4h GeLU MLP
    and dropout), redone for these layers with d = `dtype` bytes, per token:
    - two RMSNorms, each keeping its input in fp32 (4h), its normalised input and its output (2·d·h);
    - attention with fused kernels (sdpa, flash), which recompute the attention matrix: query, key,
      value and output, 2·d·(q + kv) for q and kv the widths of the query and key-value heads; eager
      attention keeps the query, the KV heads repeated to the query's width and the output (4·d·q), and
      the fp32 softmax with its d-byte copy, a·s·(4 + d);
    - the gated MLP of width I: gate and up outputs, SiLU(gate) and their product, 4·d·I.
    It counts the tensors autograd saves, not temporaries between them or allocator overhead.
    """
    d = DTYPE_BYTES[dtype]
    q_width, kv_width = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if fused_attention:
        attention = 2 * d * (q_width + kv_width)
    else:
        attention = 4 * d * q_width + shape.num_heads * seq_len * (FP32 + d)
    per_token = 2 * _norm_bytes(shape, dtype) + attention + 4 * d * shape.intermediate_size
    return micro_batch * seq_len * per_token


def _norm_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes an RMSNorm keeps per token: its input in fp32, its normalised input and its output in `dtype`."""
    return (FP32 + 2 * DTYPE_BYTES[dtype]) * shape.hidden_size


def activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    *,
    checkpointing: bool = False,
    fused_attention: bool = True,
) -> int:
    """Estimated activations a training micro-batch keeps for backward: every layer's and the final norm's.

    With gradient checkpointing each layer keeps only its input (d·h per token), and backward recomputes
    one layer at a time. See `layer_activation_bytes`; the logits are `logits_bytes`.
    """
    layer = layer_activation_bytes(shape, micro_batch, seq_len, dtype, fused_attention=fused_attention)
    final_norm = micro_batch * seq_len * _norm_bytes(shape, dtype)
    if checkpointing:
        inputs = shape.num_layers * micro_batch * seq_len * shape.hidden_size * DTYPE_BYTES[dtype]
        return inputs + layer + final_norm
    return shape.num_layers * layer + final_norm


def logits_bytes(
    shape: ModelShape,
    rows: int,
    seq_len: int,
    scored: int,
    dtype: str = "bf16",
    *,
    training: bool,
    kind: str = "causal_lm",
) -> int:
    """Estimated bytes of the output head's logits and the fp32 log-softmax over the `scored` positions.

    Forward: logits for every position in `dtype`, then the fp32 copy and log-softmax of the scored
    ones. Training also holds the logits' gradient in `dtype` and two fp32 gradients of the log-softmax.
    """
    width = shape.output_width(kind)
    per_row = DTYPE_BYTES[dtype] * seq_len * (2 if training else 1) + FP32 * scored * (3 if training else 2)
    return rows * width * per_row


def kv_cache_bytes(shape: ModelShape, tokens: int, dtype: str = "bf16") -> int:
    """Keys and values of `tokens` tokens over all layers: 2 x layers x kv_heads x head_dim x tokens x dtype bytes."""
    return tokens * shape.facts.kv_bytes_per_token(dtype)


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class RankEstimate:
    """One rank of a role: what it holds throughout (`resident`) and what each phase adds at its peak.

    `places` are the memories `budget` covers: the device on accelerators, device and host on CPU
    (where a "device" is host memory too). `total` is the resident bytes plus the largest phase there.
    """

    role: str
    strategy: str
    ranks: int
    resident: tuple[MemoryItem, ...]
    phases: dict[str, tuple[MemoryItem, ...]]
    places: tuple[Place, ...]
    budget: int | None
    budget_source: str
    notes: tuple[str, ...] = field(default=())

    def bytes_of(self, items: tuple[MemoryItem, ...]) -> int:
        """Bytes of `items` in the memories the budget covers."""
        return sum(item.nbytes for item in items if item.place in self.places)

    @property
    def peak_phase(self) -> str | None:
        """The phase that adds the most, or None when the role has none."""
        return max(self.phases, key=lambda name: self.bytes_of(self.phases[name]), default=None)

    @property
    def total(self) -> int:
        """Estimated peak bytes of this rank in the budgeted memory."""
        peak = self.phases[self.peak_phase] if self.peak_phase else ()
        return self.bytes_of(self.resident) + self.bytes_of(peak)

    @property
    def elsewhere(self) -> int:
        """Resident bytes outside the budgeted memory (offloaded to host memory on accelerators, or to NVMe)."""
        return sum(item.nbytes for item in self.resident if item.place not in self.places)

    @property
    def over(self) -> bool:
        """Whether the estimate exceeds the budget (False when the budget is unknown)."""
        return self.budget is not None and self.total > self.budget

    def lines(self) -> list[str]:
        """A human-readable breakdown: headline, resident items, each phase, notes."""
        verdict = "unknown budget" if self.budget is None else ("OVER" if self.over else "fits")
        budget = f" of {self.budget / GiB:.2f} GiB ({self.budget_source})" if self.budget is not None else ""
        lines = [
            f"{self.role} ({self.strategy}, {self.ranks} rank{'s' if self.ranks > 1 else ''}): "
            f"~{self.total / GiB:.2f} GiB per rank{budget}: {verdict}"
        ]
        lines.append("  resident: " + _items_text(self.resident))
        for name, items in self.phases.items():
            marker = " (peak)" if name == self.peak_phase else ""
            lines.append(f"  {name}{marker}: +{self.bytes_of(items) / GiB:.2f} GiB: " + _items_text(items))
        if self.elsewhere:
            lines.append(f"  offloaded (outside the budget): {self.elsewhere / GiB:.2f} GiB")
        lines += [f"  note: {note}" for note in self.notes]
        return lines


def _items_text(items: tuple[MemoryItem, ...]) -> str:
    parts = [f"{i.name} {i.nbytes / GiB:.3f}" + (f" ({i.place})" if i.place != "device" else "") for i in items]
    return ", ".join(parts) or "nothing"


def estimate_rank(
    role: WorkerConfig,
    *,
    prompt_length: int,
    response_length: int,
    prompts: int | None = None,
    shape: ModelShape | None = None,
    kind: str = "causal_lm",
    platform: str = "cpu",
    device_memory: int | None = None,
    host_memory: int | None = None,
    ranks_on_node: int = 1,
) -> RankEstimate | None:
    """Estimate the memory of one rank of `role` (resolved: name and world size set); None without a strategy.

    Sequences are `prompt_length` + `response_length` tokens, log-probs scored over the response;
    `prompts` is the batch a generation call spreads over the role's ranks (default: `infer_batch_size`
    per rank). The model's `shape` defaults to `model_shape(role.model_args.model_name_or_path)`; `kind`
    is what the worker loads (`causal_lm`, `value`, `reward`). The budget is `device_memory` bytes per
    device on an accelerator `platform` (unknown if None), or on "cpu" the host's memory (`host_memory`,
    default this machine's) divided by the `ranks_on_node` that share it.
    """
    if role.strategy_args is None:
        return None
    strategy = role.strategy_args.strategy_name
    if strategy not in STRATEGY_KINDS:
        raise ValueError(f"no memory estimate for strategy {strategy!r}; known: {', '.join(STRATEGY_KINDS)}")
    shape = shape or model_shape(role.model_args.model_name_or_path)
    on_cpu = platform == "cpu"
    places: tuple[Place, ...] = ("device", "host") if on_cpu else ("device",)
    devices = role.num_devices_per_worker
    if on_cpu:
        host = host_memory or host_memory_bytes()
        budget, source = host // ranks_on_node, f"host {host / GiB:.1f} GiB / {ranks_on_node} ranks on the node"
    elif device_memory is None:
        budget, source = None, "device memory unknown"
    else:
        budget, source = device_memory * devices, f"{devices} x {device_memory / GiB:.1f} GiB device memory"
    lengths = _Lengths(prompt_length, response_length, prompts)
    if STRATEGY_KINDS[strategy] == "train":
        resident, phases, notes = _train_rank(role, shape, kind, lengths, platform)
    elif STRATEGY_KINDS[strategy] == "infer":
        resident, phases, notes = _infer_rank(role, shape, kind, lengths)
    else:
        resident, phases, notes = _engine_rank(role, shape, kind, lengths, platform, budget)
    return RankEstimate(role.name, strategy, role.world_size or 1, resident, phases, places, budget, source, notes)


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


_Built = tuple[tuple[MemoryItem, ...], dict[str, tuple[MemoryItem, ...]], tuple[str, ...]]


def _zero_block(role: WorkerConfig) -> tuple[int, str, str, dict[str, Any]]:
    """ZeRO stage, optimizer and parameter offload devices, and the zero_optimization block (as deepspeed_config)."""
    zero = (role.strategy_args.strategy_config or {}).get("zero_optimization", {})
    offload = [zero.get(key, {}).get("device", "none") for key in ("offload_optimizer", "offload_param")]
    return int(zero.get("stage", 0)), offload[0], offload[1], zero


def _model_params(role: WorkerConfig, shape: ModelShape, kind: str) -> tuple[int, int]:
    """(all parameters, trainable parameters) of the role's model, LoRA adapters included."""
    params = shape.param_count(kind)
    args = role.model_args
    if args.lora_rank <= 0:
        return params, params
    trainable = lora_params(shape, args.lora_rank, list(args.lora_target_modules), kind)
    return params + trainable, trainable


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


def _forward_phase(role: WorkerConfig, shape: ModelShape, kind: str, lengths: _Lengths) -> tuple[MemoryItem, ...]:
    """A log-prob forward of `infer_batch_size` rows without gradients: one layer's working set and the logits."""
    dtype, rows = role.model_args.dtype, role.infer_batch_size
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


def _tensor_parallel_share(shape: ModelShape, params: int, tp_size: int) -> int:
    """Parameters on one rank when the decoder layers' linear weights are split over `tp_size` ranks.

    Embeddings, norms and the output head are counted whole on every rank (an upper bound: DeepSpeed
    AutoTP also splits some heads).
    """
    linear = shape.num_layers * sum(i * o + (o if bias else 0) for i, o, bias in shape.linear_shapes().values())
    return params - linear + _share(linear, tp_size)


def _train_rank(role: WorkerConfig, shape: ModelShape, kind: str, lengths: _Lengths, platform: str) -> _Built:
    stage, offload_optimizer, offload_params, zero = _zero_block(role)
    dtype, args, ranks = role.model_args.dtype, role.training_args, role.dp_size
    params, trainable = _model_params(role, shape, kind)
    tp_size = role.model_parallel_size
    notes: tuple[str, ...] = ()
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
            dtype=dtype,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
        )
    )
    # Stages 1-2 double-buffer their reduce bucket for overlap_comm; stage 3 keeps one. A GPU allocates the
    # buckets in full; on CPU only the pages the gradients passing through them fill are touched (docs/zero_memory.md).
    count = 2 if zero.get("overlap_comm") and stage in (1, 2) else 1
    elements = count * int(zero.get("reduce_bucket_size", _DS_REDUCE_BUCKET))
    buckets = MemoryItem("buckets", DTYPE_BYTES[dtype] * (min(elements, trainable) if platform == "cpu" else elements))
    fused = role.model_args.attn_implementation != "eager"
    micro = args.per_device_train_batch_size
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


def _infer_rank(role: WorkerConfig, shape: ModelShape, kind: str, lengths: _Lengths) -> _Built:
    params, _ = _model_params(role, shape, kind)
    dtype = role.model_args.dtype
    forward = list(_forward_phase(role, shape, kind, lengths))
    generation = list(_generation_phase(role, shape, lengths))
    stage, _, offload_params, zero = _zero_block(role)
    if role.strategy_args.strategy_name == "deepspeed_infer" and stage == 3:
        place: Place = {"cpu": "host", "nvme": "nvme"}.get(offload_params, "device")
        resident = (MemoryItem("params", DTYPE_BYTES[dtype] * _share(params, role.dp_size), place),)
        forward.append(_gathered(shape, dtype, params, zero, training=False))
        generation.append(_gathered(shape, dtype, params, zero, training=False))
    else:
        resident = (MemoryItem("params", DTYPE_BYTES[dtype] * params),)
    return resident, {"log-prob forward": tuple(forward), "generation": tuple(generation)}, ()


def _engine_rank(
    role: WorkerConfig, shape: ModelShape, kind: str, lengths: _Lengths, platform: str, budget: int | None
) -> _Built:
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
        space, where = int(config["kv_cache_space_gb"] * GiB), f"kv_cache_space_gb={config['kv_cache_space_gb']}"
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
