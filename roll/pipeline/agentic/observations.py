"""Observations as token ids, each encoded on its own: the history of an episode is never re-tokenised.

Without a chat template an observation is its text plus a newline. With one, the first observation is the
template's user turn with the generation prompt, and each later one the template's *next-turn delta*: what
rendering one more message adds after an assistant turn, minus the end-of-turn token the policy sampled
itself (the stop token its action ended on).

An environment with tools (`tool_schemas()`, as `roll.envs.tools.ToolEnv` has) gets their function schemas
rendered through the template's `tools` argument, as a Qwen2.5 or Hermes model reads them (a system section
listing them inside `<tools></tools>` and the `<tool_call>` convention): in the first observation, and in the
renderings later turns' deltas are taken from.

An observation with images (a list of text and image parts, for a vision-language policy) is rendered the same
way, each image part as the template's image span, and then encoded by the policy's processor (`encode_first`,
`encode_next`): its ids hold each image's tokens, and its pixels and image grid come with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from roll.datasets.image_prompts import encode_text_and_images, open_image
from roll.envs.protocol import Observation

# Placeholder turns whose rendering is subtracted to find what the template adds around a new message.
_USER, _ASSISTANT = "\x00u\x00", "\x00a\x00"


@dataclass
class EncodedObservation:
    """An observation's ids, and when it shows images their `pixel_values` `[patches, dim]` and `image_grid_thw`
    `[images, 3]` (None for text)."""

    ids: list[int]
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None


class ObservationEncoder:
    """Token ids of observations for `tokenizer`, plain text or through its chat template with `tools` (function
    schemas; none by default); a vision-language policy's `processor` encodes observations with images. `template`
    is a chat template rendered instead of the tokenizer's (the agent endpoint's plain layout)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: bool,
        tools: Sequence[dict[str, Any]] = (),
        processor: ProcessorMixin | None = None,
        template: str | None = None,
    ) -> None:
        if chat_template and not template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("env.apply_chat_template is true but the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tools = list(tools)
        self.processor = processor
        self.template = template  # a chat template rendered instead of the tokenizer's own

    def encode_first(self, observation: Observation) -> EncodedObservation:
        """`first` for an observation of text or of text and image parts."""
        if isinstance(observation, str):
            return EncodedObservation(self.first(observation))
        content, images = self._image_parts(observation)
        return self._with_images(self.render([{"role": "user", "content": content}], True), images)

    def encode_next(
        self, observation: Observation, role: str = "user", action_end: str | None = None
    ) -> EncodedObservation:
        """`next` for an observation of text or of text and image parts."""
        if isinstance(observation, str):
            return EncodedObservation(self.next(observation, role, action_end))
        content, images = self._image_parts(observation)
        return self._with_images(self._next_text([{"role": role, "content": content}], action_end), images)

    def _image_parts(self, observation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
        """The parts as the chat template renders them (`{"type": "image"}`) and the images they show, opened."""
        if self.processor is None or not self.chat_template:
            raise ValueError(
                "the environment returned an observation with images: the policy must be a vision-language model "
                "and env.apply_chat_template true (the template places each image's tokens)"
            )
        content = [{"type": "image"} if part["type"] == "image" else part for part in observation]
        return content, [open_image(part["image"]) for part in observation if part["type"] == "image"]

    def _with_images(self, text: str, images: list[Any]) -> EncodedObservation:
        encoded = encode_text_and_images(text, images, self.processor)
        return EncodedObservation(encoded["prompt_ids"], encoded["pixel_values"], encoded["image_grid_thw"])

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """`messages` rendered by the chat template as text, with the tools."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.template,
        )

    def renders_tools(self) -> bool:
        """Whether the chat template writes the tools into the prompt (a template without `tools` ignores them)."""
        messages = [{"role": "user", "content": _USER}]
        with_tools = self.render(messages, add_generation_prompt=True)
        without_tools = ObservationEncoder(self.tokenizer, True, template=self.template).render(messages, True)
        return bool(self.tools) and with_tools != without_tools

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
        return self._ids(self._next_text(messages, action_end))

    def _next_text(self, messages: Sequence[dict[str, Any]], action_end: str | None) -> str:
        """The text the template appends after an action for `messages` (see `next_messages`)."""
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
        return closing + after[len(before) :]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
