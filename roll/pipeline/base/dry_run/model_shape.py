"""The shape of a model and its parameter count, read from its config.json alone.

Counts are exact for the dense decoders it knows (llama, mistral, qwen2, qwen3 layouts) and for the vision
tower of a Qwen2.5-VL; a mixture of experts is refused. Reading a model directory imports no torch and builds
nothing (a `tiny://` reference imports the tiny-model module for its tokenizer's size, but builds no model).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll.configs.model_dir import ModelFacts

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_STORED_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


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
    stored_dtype: str | None = None  # the checkpoint's dtype in roll's names (fp32, bf16, fp16), when it says
    vision_params: int = 0  # a vision-language model's vision tower and patch merger (`vision_tower_params`)

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
        # Qwen2 (and Qwen2.5-VL's decoder) has q/k/v biases whatever the config says, and no o_proj bias.
        qwen2 = model_type in ("qwen2", "qwen2_5_vl", "qwen2_5_vl_text")
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
            stored_dtype=_STORED_DTYPES.get(str(merged.get("dtype") or merged.get("torch_dtype"))),
            vision_params=vision_tower_params(config["vision_config"]) if config.get("vision_config") else 0,
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
        decoder = embeddings + self.num_layers * self.layer_params() + self.hidden_size + self.head_params(kind)
        return decoder + self.vision_params

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


def vision_tower_params(vision: Mapping[str, Any]) -> int:
    """Parameters of a Qwen2.5-VL vision tower from its `vision_config`: the patch embedding (a bias-free 3D
    convolution), `depth` blocks (two RMSNorms, qkv and output projections, a gated MLP, all with biases) and the
    merger (an RMSNorm, then an MLP from 2 x 2 merged patches to the decoder's width)."""
    hidden, inter, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    patch = vision.get("in_channels", 3) * vision.get("temporal_patch_size", 2) * vision.get("patch_size", 14) ** 2
    block = 2 * hidden + (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden)
    block += 2 * (hidden * inter + inter) + (inter * hidden + hidden)
    merged = hidden * vision.get("spatial_merge_size", 2) ** 2
    merger = hidden + (merged * merged + merged) + (merged * vision["out_hidden_size"] + vision["out_hidden_size"])
    return patch * hidden + depth * block + merger


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
    if arch == "qwen2_5_vl":
        from roll.models.tiny_vlm import tiny_vlm_config

        return ModelShape.from_config(tiny_vlm_config(query, reference))
    fields: dict[str, Any] = {"arch": arch or "qwen2"}
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key in TinyModelSpec.__dataclass_fields__ and key != "arch":
            fields[key] = value.lower() == "true" if key == "tie_word_embeddings" else int(value)
        elif key != "seed":
            raise ValueError(f"{reference!r}: unknown tiny-model option {key!r}")
    spec = TinyModelSpec(**fields)
    config = {"model_type": spec.arch, "dtype": "float32", **_config_kwargs(spec, build_char_tokenizer())}
    return ModelShape.from_config(config)


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
