"""A reward model's score read at each row's last attended token, whatever ids pad the row.

transformers pools a sequence-classification model's logits at the last token that differs from the config's
pad id. That misses the final EOS when pad == eos (Qwen2.5 base), and reads padding when the engine padded
with another id (Llama-3-Instruct: a list of EOS ids and no pad). roll knows which tokens are real, so the
pooling reads the head's per-token output at the last position the attention mask keeps.
"""

from __future__ import annotations

from typing import Any

import torch

# The names transformers gives a sequence-classification head (decoder LMs use `score`).
HEAD_NAMES = ("score", "classifier")


def classification_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module producing a sequence-classification model's per-token logits (under PEFT: its wrapper)."""
    named = [(name, module) for name, module in model.named_modules() if name.split(".")[-1] in HEAD_NAMES]
    if not named:
        raise ValueError(f"{type(model).__name__} has no classification head named {' or '.join(HEAD_NAMES)}")
    return min(named, key=lambda item: item[0].count("."))[1]


def pool_at_last_attended_token(model: torch.nn.Module) -> None:
    """Make `model(...).logits` `[B, labels]` the head's output at each row's last attended token.

    Calls without an `attention_mask` (packed rows) keep transformers' own pooling.
    """
    captured: dict[str, torch.Tensor] = {}

    def keep_token_logits(_module: torch.nn.Module, _args: Any, output: torch.Tensor) -> None:
        captured["logits"] = output

    def pool(_module: torch.nn.Module, _args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        token_logits, mask = captured.pop("logits", None), kwargs.get("attention_mask")
        if token_logits is None or mask is None or token_logits.dim() != 3:
            return output
        last = (torch.arange(mask.shape[1], device=mask.device) * mask.bool()).argmax(-1)
        output.logits = token_logits[torch.arange(len(last), device=last.device), last.to(token_logits.device)]
        return output

    classification_head(model).register_forward_hook(keep_token_logits)
    model.register_forward_hook(pool, with_kwargs=True)
