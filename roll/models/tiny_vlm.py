"""A tiny randomly initialised Qwen2.5-VL (a small vision tower before a small decoder) and its processor, built
locally from transformers' own Qwen2.5-VL classes for tests and the CPU recipe (`tiny://qwen2_5_vl`).

The tokenizer is the character-level one of `roll.models.tiny` with Qwen's vision tokens added; the chat template
reads OpenAI/HF chat messages whose content is text or a list of `{"type": "image"}` and `{"type": "text"}` parts.
The directory is an ordinary Hugging Face checkpoint: `roll.models.processors.load_processor` and
`AutoModelForImageTextToText` load it as they load a real Qwen2.5-VL.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from roll.models.build_cache import build_in_cache, read_marker
from roll.models.processors import VISION_TOKENS, image_only_processor
from roll.models.tiny import build_char_tokenizer, decoder_shape, write_seeded_model

VLM_ARCH = "qwen2_5_vl"
SPEC_MARKER = "roll_tiny_vlm_spec.json"
_BUILD_VERSION = 1

# `<role>: content` lines as the text tiny models read them; an image part is Qwen's vision span, which the
# processor widens to one `<|image_pad|>` per merged patch.
TINY_VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>: ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>: ' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyVLMSpec:
    """Shape of a tiny Qwen2.5-VL: the decoder (head_dim 32) and a vision tower of 14-pixel patches merged 2x2.

    `max_image_pixels` caps the pixels the image processor keeps of an image (larger ones are resized down):
    112 x 112 gives at most 64 patches, 16 image tokens.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 2
    vision_intermediate_size: int = 128
    max_image_pixels: int = 112 * 112

    def __post_init__(self) -> None:
        head_dim, rest = divmod(self.hidden_size, self.num_heads)
        if rest or self.num_heads % self.num_kv_heads or head_dim % 4:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads} with a head size "
                f"that is a multiple of 4, and num_heads a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.vision_hidden_size % self.vision_heads:
            raise ValueError(f"vision_hidden_size={self.vision_hidden_size} must be a multiple of vision_heads")
        if self.max_image_pixels < 28 * 28:
            raise ValueError(f"max_image_pixels={self.max_image_pixels} is below one merged patch (28 x 28)")


def _mrope_section(head_dim: int) -> list[int]:
    """How the rotary half-dimensions split over (time, height, width), in Qwen2.5-VL's proportions (16:24:24)."""
    half = head_dim // 2
    time = half // 4
    height = (half - time) // 2
    return [time, height, half - time - height]


def make_tiny_vlm(output_dir: str | Path, spec: TinyVLMSpec | None = None, seed: int = 0) -> Path:
    """Save a seeded random Qwen2.5-VL (float32 safetensors) with its processor in `output_dir`; return it.

    A directory already built, whole, with the same spec and seed is returned as it is.
    """
    spec = spec or TinyVLMSpec()
    path = Path(output_dir)
    identity = {"version": _BUILD_VERSION, "spec": asdict(spec), "seed": seed}
    if read_marker(path, SPEC_MARKER) == identity:
        return path
    processor = _vlm_processor(spec)
    tokenizer = processor.tokenizer
    config = Qwen2_5_VLConfig(**_config_kwargs(spec, tokenizer))
    write_seeded_model(
        path, lambda: Qwen2_5_VLForConditionalGeneration(config), seed, processor, (SPEC_MARKER, identity)
    )
    return path


def tiny_vlm_processor(reference: str) -> Any:
    """The processor `tiny://qwen2_5_vl?<query>` is built with, made in memory (no model is built)."""
    _, _, query = reference.partition("?")
    spec, _ = _parse(query, reference)
    return _vlm_processor(spec)


def _vlm_processor(spec: TinyVLMSpec) -> Any:
    """The image-only Qwen2.5-VL processor of the tiny VLM's tokenizer and image limit."""
    return image_only_processor(_vlm_tokenizer(spec), spec.max_image_pixels, TINY_VLM_CHAT_TEMPLATE)


def _vlm_tokenizer(spec: TinyVLMSpec) -> Any:
    """The character-level tokenizer with Qwen's vision tokens and the tiny VLM chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in VISION_TOKENS.values()])
    tokenizer.model_max_length = spec.max_position_embeddings
    tokenizer.chat_template = TINY_VLM_CHAT_TEMPLATE
    return tokenizer


def _config_kwargs(spec: TinyVLMSpec, tokenizer: Any) -> dict[str, Any]:
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKENS.items()}
    text = {
        "vocab_size": len(tokenizer),
        **decoder_shape(spec),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": _mrope_section(spec.hidden_size // spec.num_heads),
        },
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision = {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden_size,
        "intermediate_size": spec.vision_intermediate_size,
        "num_heads": spec.vision_heads,
        "out_hidden_size": spec.hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [spec.vision_depth - 1],
    }
    return {
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["image"],
        "video_token_id": ids["video"],
        "vision_start_token_id": ids["vision_start"],
        "vision_end_token_id": ids["vision_end"],
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
    }


def tiny_vlm_config(query: str, reference: str) -> dict[str, Any]:
    """The config.json `tiny://qwen2_5_vl?<query>` would be built with, without building it (for the dry run)."""
    spec, _ = _parse(query, reference)
    tokenizer = _vlm_tokenizer(spec)
    return {"model_type": VLM_ARCH, "dtype": "float32", **Qwen2_5_VLConfig(**_config_kwargs(spec, tokenizer)).to_dict()}


def resolve_tiny_vlm(query: str, reference: str, cache_dir: str | None = None) -> str:
    """The cache directory of `tiny://qwen2_5_vl?<query>` (TinyVLMSpec fields and `seed`), built on first use."""
    spec, seed = _parse(query, reference)
    identity = {"version": _BUILD_VERSION, "spec": asdict(spec), "seed": seed}
    build = lambda path: make_tiny_vlm(path, spec, seed)  # noqa: E731
    return build_in_cache("tiny_vlm", spec, seed, build, (SPEC_MARKER, identity), cache_dir)


def _parse(query: str, reference: str) -> tuple[TinyVLMSpec, int]:
    fields: dict[str, int] = {}
    seed = 0
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key == "seed":
            seed = int(value)
        elif key in TinyVLMSpec.__dataclass_fields__:
            fields[key] = int(value)
        else:
            valid = ", ".join(["seed", *TinyVLMSpec.__dataclass_fields__])
            raise ValueError(f"{reference!r}: unknown tiny-model option {key!r}; valid: {valid}")
    return TinyVLMSpec(**fields), seed
