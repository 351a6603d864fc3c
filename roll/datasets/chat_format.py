"""A prompt conversation as the text the model reads: through the tokenizer's chat template, or as plain text."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from roll.configs.schema import ConfigError


def use_chat_template(setting: bool | None, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether prompts go through the chat template: `data.apply_chat_template`, null meaning "when there is one"."""
    available = getattr(tokenizer, "chat_template", None) is not None
    if setting and not available:
        raise ConfigError(
            f"data.apply_chat_template=true but the tokenizer of {tokenizer.name_or_path} has no chat template; "
            "set data.apply_chat_template=false (or null) to feed prompts as plain text"
        )
    return available if setting is None else setting


def format_prompt(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, chat_template: bool, system_prompt: str = ""
) -> str:
    """The prompt text of `messages` (ending with a user turn), `system_prompt` first unless they start with one.

    With the chat template the text ends with the generation prompt (where the assistant's turn begins);
    without it, the turns' contents are joined by newlines, so a one-turn prompt is its text unchanged.
    """
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(turn["content"] for turn in messages)
