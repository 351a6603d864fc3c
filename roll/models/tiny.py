"""A tiny randomly initialised causal LM and a character-level tokenizer, built locally for tests and demos."""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from roll.models.build_cache import build_in_cache, read_marker, write_marker
from roll.models.chat_templates import TINY_CHAT_TEMPLATE

DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + "+-*/=()?.,:;!'\"#<>_%"
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPEC_MARKER = "roll_tiny_spec.json"
# Bump when the build changes, so that directories made by an older build are rebuilt (2: the chat template
# renders `tools`; 3: weights written by any rank, see save_on_any_rank).
_BUILD_VERSION = 3

# The template of the tiny tokenizers, which renders `tools` (roll.models.chat_templates).
CHAT_TEMPLATE = TINY_CHAT_TEMPLATE

_ARCHITECTURES: dict[str, tuple[type[PreTrainedConfig], type[PreTrainedModel]]] = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of `alphabet` plus `<pad>` (id 0), `<bos>`, `<eos>`, `<unk>`.

    It is a byte-level BPE with no merges rather than a WordLevel model: AutoTokenizer loads any saved
    qwen2 checkpoint as `Qwen2Tokenizer`, which rebuilds a byte-level BPE from the saved vocabulary, and
    only a byte-level vocabulary tokenizes the same way under both loaders. Characters outside ASCII take
    one token per UTF-8 byte.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = dict.fromkeys(symbol for char in alphabet for symbol in byte_level.pre_tokenize_str(char)[0][0])
    vocab = {token: i for i, token in enumerate([PAD, BOS, EOS, UNK, *symbols])}
    backend = Tokenizer(models.BPE(vocab, [], unk_token=UNK))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD, BOS, EOS, UNK])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny decoder; the defaults give head_dim 32, the smallest vLLM's attention takes."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    # Rows of the embedding (and LM head); 0 means one per token. Larger pads the vocabulary beyond the
    # tokenizer, as real checkpoints do (Qwen2.5-0.5B: 151,936 rows for 151,665 tokens), for full-size shapes.
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.arch not in _ARCHITECTURES:
            raise ValueError(f"arch={self.arch!r} is not one of {', '.join(_ARCHITECTURES)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}, "
                f"and num_heads a multiple of num_kv_heads={self.num_kv_heads}"
            )


def make_tiny_model(
    output_dir: str | Path, spec: TinyModelSpec | None = None, seed: int = 0, alphabet: str = DEFAULT_ALPHABET
) -> Path:
    """Save a seeded random causal LM (float32 safetensors) and its char tokenizer in `output_dir`; return it.

    A directory already built, whole, with the same spec, seed and alphabet is returned as it is.
    """
    spec = spec or TinyModelSpec()
    path = Path(output_dir)
    identity = tiny_model_identity(spec, seed, alphabet)
    if read_marker(path, SPEC_MARKER) == identity:
        return path
    tokenizer = build_char_tokenizer(alphabet)
    tokenizer.model_max_length = spec.max_position_embeddings
    config_cls, model_cls = _ARCHITECTURES[spec.arch]
    config = config_cls(**_config_kwargs(spec, tokenizer))
    write_seeded_model(path, lambda: model_cls(config), seed, tokenizer, (SPEC_MARKER, identity))
    return path


def write_seeded_model(
    path: Path, make_model: Callable[[], PreTrainedModel], seed: int, companion: Any, marker: tuple[str, dict]
) -> None:
    """Build `make_model()` in float32 under `seed` and write it to `path` with `companion` (its tokenizer or
    processor, saved with `save_pretrained`), then the build `marker` (file name, identity) that vouches for it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make_model().to(torch.float32)
    # Removed before writing so that an interrupted rebuild is never mistaken for the previous build.
    (path / marker[0]).unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    save_on_any_rank(model, path)
    companion.save_pretrained(path)
    write_marker(path, *marker)


def save_on_any_rank(model: PreTrainedModel, directory: Path) -> None:
    """Write what `model.save_pretrained(directory)` writes for a tiny model (its config, generation config and
    safetensors, a tied weight under its first name only), from whichever process builds it.

    transformers writes a model's files only on rank 0 of an initialised process group, and a cache entry may be
    built by any rank of a role: built by rank 1, an entry had every file but the model's weights.
    """
    directory.mkdir(parents=True, exist_ok=True)
    # Recorded in config.json as save_pretrained records them (vLLM picks the model class by its architecture).
    model.config.dtype, model.config.architectures = model.dtype, [type(model).__name__]
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
    tensors: dict[str, torch.Tensor] = {}
    stored: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in stored:  # a tied weight is stored once, as save_pretrained does
            stored.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def tiny_model_identity(spec: TinyModelSpec, seed: int, alphabet: str = DEFAULT_ALPHABET) -> dict[str, Any]:
    """What a tiny model's build marker vouches for: the build's version, the spec, the seed and the alphabet."""
    return {"version": _BUILD_VERSION, "spec": asdict(spec), "seed": seed, "alphabet": alphabet}


def decoder_shape(spec: Any) -> dict[str, int]:
    """A tiny spec's decoder shape (its hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads and
    max_position_embeddings) as transformers' configs name it."""
    return {
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
    }


def _config_kwargs(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    if spec.vocab_size and spec.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={spec.vocab_size} is below the tokenizer's {len(tokenizer)} tokens (0: as many)")
    return {
        "vocab_size": spec.vocab_size or len(tokenizer),
        **decoder_shape(spec),
        "tie_word_embeddings": spec.tie_word_embeddings,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


TINY_SCHEME = "tiny://"


def resolve_model_path(model_name_or_path: str, cache_dir: str | None = None) -> str:
    """A local model directory for `model_name_or_path`; `tiny://...` references are built on first use.

    `tiny://qwen2` or `tiny://llama?hidden_size=256&num_layers=4&seed=1` name a tiny model of
    `TinyModelSpec` fields (`tiny://qwen2_5_vl?...` a vision-language one of `roll.models.tiny_vlm.TinyVLMSpec`);
    it is built once under `cache_dir` (default `$ROLL_CACHE_DIR` or `~/.cache/roll`), under a file lock so
    concurrent workers build it once, and renamed into place when whole.
    Other values pass through.
    """
    if not model_name_or_path.startswith(TINY_SCHEME):
        return model_name_or_path
    arch, _, query = model_name_or_path[len(TINY_SCHEME) :].partition("?")
    if arch == "qwen2_5_vl":
        from roll.models.tiny_vlm import resolve_tiny_vlm  # it builds on this module

        return resolve_tiny_vlm(query, model_name_or_path, cache_dir)
    fields: dict[str, Any] = {"arch": arch or "qwen2"}
    seed = 0
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key == "seed":
            seed = int(value)
        elif key in TinyModelSpec.__dataclass_fields__ and key != "arch":
            fields[key] = value.lower() == "true" if key == "tie_word_embeddings" else int(value)
        else:
            valid = ", ".join(["seed", *(k for k in TinyModelSpec.__dataclass_fields__ if k != "arch")])
            raise ValueError(f"{model_name_or_path!r}: unknown tiny-model option {key!r}; valid: {valid}")
    spec = TinyModelSpec(**fields)
    build = lambda path: make_tiny_model(path, spec, seed=seed)  # noqa: E731
    return build_in_cache("tiny", spec, seed, build, (SPEC_MARKER, tiny_model_identity(spec, seed)), cache_dir)
