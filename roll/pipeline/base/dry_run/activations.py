"""Bytes the tokens of a batch take while the model runs: activations, logits and the KV cache.

Activations are an **estimate**: Korthikanti et al.'s (2022) count of what each op saves for backward,
redone for Llama/Qwen layers (fp32 RMSNorm inputs, a gated MLP; the s² attention term only for eager
attention, since fused kernels keep no attention matrix). The logits are the output head's, with the fp32
log-softmax over the scored positions. A KV cache is 2 × layers × kv_heads × head_dim × tokens × dtype bytes.
"""

from __future__ import annotations

from roll.configs.model_dir import DTYPE_BYTES
from roll.pipeline.base.dry_run.model_shape import ModelShape
from roll.pipeline.base.dry_run.model_states import FP32


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
