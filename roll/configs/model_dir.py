"""What validation needs from a local model directory, read from its JSON files without loading the model.

A model named by hub id has been fetched by then (roll/models/hub.py): validation reads its snapshot directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll.configs.schema import ConfigError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# At least one of these must be present for a tokenizer to load; the JSON ones must parse.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelFacts:
    """Sizes from a model's config.json; None where the config does not say."""

    max_positions: int | None
    num_layers: int | None
    kv_width: int | None  # width of a token's keys (= values) in one layer: key-value heads x head size

    def kv_bytes_per_token(self, dtype: str) -> int | None:
        """Bytes a token's keys and values take over all layers in `dtype`, or None when unknown."""
        if self.num_layers is None or self.kv_width is None:
            return None
        return self.num_layers * 2 * self.kv_width * DTYPE_BYTES[dtype]


def read_model_dir(path: str, field: str, value: str) -> ModelFacts:
    """Check that `path` (what `field`={value} resolves to) holds a config and a tokenizer that parse.

    Raise a ConfigError naming `field` and the fix; return the sizes validation compares against.
    """
    directory = Path(path).expanduser()
    where = f"{field}={value!r}"
    if not directory.is_dir():
        raise ConfigError(
            f"{where}: no such directory ({directory.resolve()}); set it to a local Hugging Face model directory, "
            "a hub id (org/name or org/name@revision, fetched into the Hugging Face cache when the config "
            "validates) or a tiny:// reference such as tiny://qwen2"
        )
    config = _read_json(directory / "config.json", where)
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not present:
        raise ConfigError(f"{where}: {directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    for name in present:
        if name.endswith(".json"):
            _read_json(directory / name, where)
    return _facts(config)


def _read_json(file: Path, where: str) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{where}: {file.parent} holds no {file.name}; is it a Hugging Face model directory?"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: {file} does not parse ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {file} does not hold a JSON object")
    return data


def _facts(config: dict[str, Any]) -> ModelFacts:
    # Multimodal configs keep the language model's sizes under text_config.
    sources = [config, config.get("text_config") or {}]

    def first(*keys: str) -> int | None:
        for source in sources:
            for key in keys:
                if isinstance(source.get(key), int) and not isinstance(source.get(key), bool):
                    return source[key]
        return None

    heads = first("num_attention_heads", "n_head")
    hidden = first("hidden_size", "n_embd", "d_model")
    head_dim = first("head_dim") or (hidden // heads if hidden and heads else None)
    kv_heads = first("num_key_value_heads") or heads
    return ModelFacts(
        max_positions=first("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"),
        num_layers=first("num_hidden_layers", "n_layer", "num_layers"),
        kv_width=kv_heads * head_dim if kv_heads and head_dim else None,
    )
