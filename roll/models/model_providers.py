"""Build what a role asks for (tokenizer, causal LM, value or reward model) from a local Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from roll.configs.worker_config import ModelArguments
from roll.models.processors import VISION_LANGUAGE_MODEL_TYPES, freeze_vision_tower
from roll.models.reward_pooling import pool_at_last_attended_token
from roll.models.tiny import TINY_SCHEME, build_char_tokenizer, resolve_model_path
from roll.platforms import resolve_dtype

ModelKind = Literal["causal_lm", "value", "reward"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_AUTO_CLASSES = {
    "causal_lm": AutoModelForCausalLM,
    "value": AutoModelForTokenClassification,
    "reward": AutoModelForSequenceClassification,
}
# PEFT's token and sequence classification tasks add the new head ("score" or "classifier") to
# `modules_to_save`, so it trains in full next to the adapters.
_PEFT_TASKS = {"causal_lm": "CAUSAL_LM", "value": "TOKEN_CLS", "reward": "SEQ_CLS"}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name: "fp32", "bf16", "fp16", or "auto" (the platform's choice)."""
    name = resolve_dtype(name)
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `model_path`, padding on the left, with the eos token as pad when it has none."""
    path = Path(resolve_model_path(model_path)).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {model_path!r} ({path.resolve()}) does not exist")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def peek_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """`load_tokenizer(model_path)` without building a tiny:// model: a tiny model's tokenizer is the char-level one."""
    return build_char_tokenizer() if model_path.startswith(TINY_SCHEME) else load_tokenizer(model_path)


def load_model(
    model_args: ModelArguments,
    kind: ModelKind = "causal_lm",
    *,
    dtype: torch.dtype | None = None,
    trainable: bool = False,
) -> torch.nn.Module:
    """Load `model_args.model_name_or_path` as a causal LM, a value model (one value per token) or a reward model.

    Value and reward models put a new one-output head on the same backbone. `dtype` overrides
    `model_args.dtype`; `trainable` turns the KV cache off. With `model_args.lora_rank` > 0 the base
    is frozen and only LoRA adapters (and a value/reward head) train.
    """
    if kind not in _AUTO_CLASSES:
        raise ValueError(f"model kind {kind!r} is not one of {', '.join(_AUTO_CLASSES)}")
    path = _model_dir(model_args.model_name_or_path)
    config = AutoConfig.from_pretrained(path)
    if trainable:
        config.use_cache = False
    if kind != "causal_lm":
        config.num_labels = 1
    if kind == "value":
        # Dropout before a regression head would give the same batch different values on each pass.
        config.classifier_dropout = 0.0
    if kind == "reward" and config.pad_token_id is None:
        # transformers refuses a batch without a pad id, although the score is read at the last attended token.
        config.pad_token_id = load_tokenizer(str(path)).pad_token_id
    auto_class = _AUTO_CLASSES[kind]
    if config.model_type in VISION_LANGUAGE_MODEL_TYPES:
        if kind != "causal_lm":
            raise ValueError(f"{model_args.model_name_or_path!r} is a vision-language model: it loads as a policy only")
        auto_class = AutoModelForImageTextToText
    model = auto_class.from_pretrained(
        path,
        config=config,
        dtype=dtype or dtype_from_name(model_args.dtype),
        attn_implementation=model_args.attn_implementation,
    )
    if trainable and model_args.freeze_vision_tower and config.model_type in VISION_LANGUAGE_MODEL_TYPES:
        freeze_vision_tower(model)
    if model_args.lora_rank > 0:
        from peft import LoraConfig, get_peft_model  # imported on use: peft costs every worker ~0.3 s of CPU

        lora_config = LoraConfig(
            task_type=_PEFT_TASKS[kind],
            r=model_args.lora_rank,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=list(model_args.lora_target_modules),
        )
        model = get_peft_model(model, lora_config)
    if kind == "reward":
        pool_at_last_attended_token(model)
    return model


def _model_dir(model_name_or_path: str) -> Path:
    path = Path(resolve_model_path(model_name_or_path)).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model_args.model_name_or_path={model_name_or_path!r}: {path.resolve()} is not a local Hugging Face "
            "model directory (no config.json); workers load local directories only (the config's validation "
            "fetches a hub id and puts its snapshot directory there)"
        )
    return path
