"""Observations as token ids, each encoded on its own: the history of an episode is never re-tokenised.

Without a chat template an observation is its text plus a newline. With one, the first observation is the
template's user turn with the generation prompt, and each later one the template's *next-turn delta*: what
rendering one more message adds after an assistant turn, minus the end-of-turn token the policy sampled
itself (the stop token its action ended on).

An environment with tools (`tool_schemas()`, as `roll.envs.tools.ToolEnv` has) gets their function schemas
rendered through the template's `tools` argument, as a Qwen2.5 or Hermes model reads them (a system section
listing them inside `<tools></tools>` and the `<tool_call>` convention): in the first observation, and in the
renderings later turns' deltas are taken from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

# Placeholder turns whose rendering is subtracted to find what the template adds around a new message.
_USER, _ASSISTANT = "\x00u\x00", "\x00a\x00"


class ObservationEncoder:
    """Token ids of observations for `tokenizer`, plain text or through its chat template with `tools` (function
    schemas; none by default)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, chat_template: bool, tools: Sequence[dict[str, Any]] = ()
    ) -> None:
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("env.apply_chat_template is true but the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tools = list(tools)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """`messages` rendered by the chat template as text, with the tools."""
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def renders_tools(self) -> bool:
        """Whether the chat template writes the tools into the prompt (a template without `tools` ignores them)."""
        messages = [{"role": "user", "content": _USER}]
        with_tools = self.render(messages, add_generation_prompt=True)
        return bool(self.tools) and with_tools != ObservationEncoder(self.tokenizer, True).render(messages, True)

    def first(self, observation: str) -> list[int]:
        """The ids of the episode's first observation (the prompt)."""
        return self.conversation([{"role": "user", "content": observation}])

    def conversation(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The ids of a whole conversation with the generation prompt (a chat request's prompt); without a chat
        template each content and a newline, as the episodes' observations are."""
        if not self.chat_template:
            return self._ids("".join(f"{message.get('content') or ''}\n" for message in messages))
        return self._ids(self.render(messages, add_generation_prompt=True))

    def next(self, observation: str, role: str = "user", action_end: str | None = None) -> list[int]:
        """The ids appended after an action: the observation as the next turn of `role` ("user" or "tool").

        `action_end` is the text of the stop token the action ended on, which the policy sampled itself: the
        tokenizer's EOS (`None`, the default), another EOS id of the generation config (Gemma's `<end_of_turn>`),
        or `""` for an action cut at `max_new_tokens`. The template's closing does not repeat it."""
        return self.next_messages([{"role": role, "content": observation}], action_end)

    def next_messages(self, messages: Sequence[dict[str, Any]], action_end: str | None = None) -> list[int]:
        """The ids appended after an action for several new turns at once (`next`'s, e.g. a chat request's tool
        results and user turn after the assistant's); without a chat template each content and a newline."""
        if not self.chat_template:
            return self.conversation(messages)
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        before = self.render(base)
        after = self.render([*base, *messages], add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template renders earlier turns differently once a turn follows them")
        # What the template writes after the assistant's text; the policy sampled its EOS part itself.
        closing = before[before.rindex(_ASSISTANT) + len(_ASSISTANT) :]
        end = (self.tokenizer.eos_token or "") if action_end is None else action_end
        if end and closing.startswith(end):
            closing = closing[len(end) :]
        return self._ids(closing + after[len(before) :])

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
