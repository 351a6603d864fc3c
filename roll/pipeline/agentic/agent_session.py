"""One agent episode as the endpoint sees it: its chat calls, grouped into segments of token ids as sampled.

A call whose messages repeat the previous call's, then the assistant turn the endpoint returned (any of its
choices), then new turns (tool results, a user turn), *extends* the segment: its prompt is the segment's ids so
far, the chosen choice's sampled ids, and the new turns encoded on their own (`ObservationEncoder.next_messages`).
The history is never re-tokenised, so the ids trained on are the ids the engine saw and sampled. Any other call
(a summary, a truncation, an edited turn) *rewrote* the history and starts a new segment, its prompt the whole
conversation rendered anew. Prompts are rendered by the policy's chat template with `env.apply_chat_template`, else
by the plain layout's (`endpoint_template`), the template the export carries.

Budgets: a segment's first prompt holds at most `max_prompt_tokens` (env.max_observation_tokens) and its
response (sampled and appended ids) at most `max_response_tokens` (env.max_trajectory_tokens); an episode makes at
most `max_calls` calls. A call beyond them is an `ApiError`, and the episode goes on.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from roll.configs.worker_config import GeneratingArguments
from roll.pipeline.agentic.chat_api import ApiError, ChatRequest, assistant_message, completion_body, invalid
from roll.pipeline.agentic.endpoint_template import plain_chat_template
from roll.pipeline.agentic.observations import ObservationEncoder


@dataclass(frozen=True)
class Sample:
    """One sampled continuation: its ids as the engine returned them, their log-probs, whether it hit a stop id."""

    ids: list[int]
    log_probs: list[float]
    stopped: bool


@dataclass
class Choice:
    """A sample as returned to the agent: the sample and the message made of it."""

    sample: Sample
    message: dict[str, Any]


@dataclass
class Call:
    """One answered call: the prompt ids the engine was given, its choices, whether it started a segment."""

    prompt_ids: list[int]
    choices: list[Choice]
    new_segment: bool


@dataclass
class Segment:
    """Ids of calls that extend each other: the first prompt, then sampled ids (loss mask 1) and appended turns
    (0); `pending` are the last call's choices, of which the next call's history names one."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    pending: list[Choice] = field(default_factory=list)

    def append(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        """Add sampled ids (with their log-probs) or appended turn ids (log-prob 0) to the response."""
        self.response_ids += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)


@dataclass(frozen=True)
class Prepared:
    """A call ready to generate: its prompt ids and sampling settings, and how it continues the episode."""

    request: ChatRequest
    prompt_ids: list[int]
    args: GeneratingArguments
    chosen: int | None  # the pending choice it extends; None: a new segment
    appended: list[int]  # the ids of its new turns after that choice


@dataclass
class SessionLimits:
    """The budgets of an episode's calls."""

    max_prompt_tokens: int
    max_response_tokens: int
    max_calls: int
    max_new_tokens: int  # actor_infer's generating_args.max_new_tokens: the cap of `max_tokens`


class AgentSession:
    """The calls of one episode, keyed by `session_id`; `prepare` then `record` answer one call."""

    def __init__(
        self,
        session_id: str,
        seed: int,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: bool,
        stop_ids: set[int],
        base_args: GeneratingArguments,
        limits: SessionLimits,
        tool_brackets: tuple[str, str] | None = None,
    ) -> None:
        self.session_id = session_id
        self.seed = seed
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.stop_ids = stop_ids
        self.base_args = base_args
        self.limits = limits
        self.tool_brackets = tool_brackets
        # Without the policy's template, the plain layout as a template: what the export's tokenizer renders.
        self.template = None if chat_template else plain_chat_template(tool_brackets)
        self.calls: list[Call] = []
        self.segments: list[Segment] = []
        self.rejected = 0  # calls answered with an error
        self.running = False  # the agent is playing (its calls are waited for before a generation wave)
        self.lock = asyncio.Lock()  # one call at a time: each extends the state the previous one left

    def prepare(self, request: ChatRequest) -> Prepared:
        """The prompt ids and sampling settings of `request`; ApiError when it exceeds a budget."""
        if len(self.calls) >= self.limits.max_calls:
            raise invalid(f"this episode made its {self.limits.max_calls} calls (env.max_turns)", code="call_limit")
        encoder = ObservationEncoder(self.tokenizer, True, request.tools, template=self.template)
        segment = self.segments[-1] if self.segments else None
        extended = _extension(segment, request.messages)
        if segment is not None and extended is not None:
            chosen, new_turns = extended
            sample = segment.pending[chosen].sample
            end = self.tokenizer.decode(sample.ids[-1:]) if sample.stopped else ""
            appended = encoder.next_messages(new_turns, action_end=end)
            prompt = segment.prompt_ids + segment.response_ids + sample.ids + appended
            used = len(segment.response_ids) + len(sample.ids) + len(appended)
        else:
            chosen, appended, used = None, [], 0
            prompt = encoder.conversation(request.messages)
            if len(prompt) > self.limits.max_prompt_tokens:
                raise invalid(
                    f"the conversation is {len(prompt)} tokens, more than a new segment's prompt may hold "
                    f"({self.limits.max_prompt_tokens}, env.max_observation_tokens)",
                    "messages",
                    "context_length_exceeded",
                )
        room = self.limits.max_response_tokens - used
        if room < 1:
            raise invalid(
                f"the episode's trajectory is {used} tokens with this call's new turns, its whole budget "
                f"(env.max_trajectory_tokens={self.limits.max_response_tokens})",
                "messages",
                "context_length_exceeded",
            )
        max_tokens = min(request.max_tokens or self.limits.max_new_tokens, self.limits.max_new_tokens, room)
        return Prepared(request, prompt, self._args(request, max_tokens), chosen, appended)

    def _args(self, request: ChatRequest, max_tokens: int) -> GeneratingArguments:
        base = self.base_args
        greedy = not base.do_sample or request.temperature == 0
        seed = request.seed if request.seed is not None else (base.seed or 0) + len(self.calls)
        return replace(
            base,
            max_new_tokens=max_tokens,
            temperature=request.temperature or base.temperature,
            top_p=request.top_p or base.top_p,
            stop_strings=list(request.stop) or list(base.stop_strings),
            seed=seed,
            do_sample=not greedy,
            num_return_sequences=1,
        )

    def record(self, prepared: Prepared, samples: list[Sample]) -> dict[str, Any]:
        """Record the answered call in its segment and return its chat.completion body."""
        request = prepared.request
        choices = []
        for sample in samples:
            text = self.tokenizer.decode(sample.ids, skip_special_tokens=True)
            choices.append(Choice(sample, assistant_message(text, request, self.tool_brackets)))
        if prepared.chosen is None:
            segment = Segment(prepared.prompt_ids)
            self.segments.append(segment)
        else:
            segment = self.segments[-1]
            sample = segment.pending[prepared.chosen].sample
            segment.append(sample.ids, sampled=True, log_probs=sample.log_probs)
            segment.append(prepared.appended, sampled=False)
        segment.messages, segment.pending = list(request.messages), choices
        self.calls.append(Call(prepared.prompt_ids, choices, new_segment=prepared.chosen is None))
        answered = [(choice.message, _finish_reason(choice, prepared.args)) for choice in choices]
        sampled_tokens = sum(len(sample.ids) for sample in samples)
        return completion_body(answered, len(prepared.prompt_ids), sampled_tokens)

    def trajectories(self) -> list[Segment]:
        """The rows trained for the episode: each segment with its last call's first choice appended."""
        rows = []
        for segment in self.segments:
            row = replace(segment, response_ids=list(segment.response_ids), loss_mask=list(segment.loss_mask))
            row.log_probs = list(segment.log_probs)
            if segment.pending:
                sample = segment.pending[0].sample
                row.append(sample.ids, sampled=True, log_probs=sample.log_probs)
            rows.append(row)
        return rows

    def tool_calls(self) -> int:
        """Tool calls in the choices the episode went on with (each call's first choice for the last one)."""
        return sum(len(call.choices[0].message.get("tool_calls") or []) for call in self.calls)


def _extension(segment: Segment | None, messages: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]] | None:
    """(the pending choice, the new turns) when `messages` extend `segment`'s last call; None when they rewrote it."""
    if segment is None:
        return None
    known = len(segment.messages)
    if len(messages) <= known + 1 or messages[:known] != segment.messages or messages[known]["role"] != "assistant":
        return None
    turn = _turn(messages[known])
    for index, choice in enumerate(segment.pending):
        if _turn(choice.message) == turn:
            return index, messages[known + 1 :]
    return None


def _turn(message: dict[str, Any]) -> tuple[str, list[tuple[str, Any]]]:
    """An assistant message as compared between calls: its text, and its tool calls' names and arguments."""
    calls = []
    for call in message.get("tool_calls") or []:
        arguments = call["function"].get("arguments")
        calls.append((call["function"]["name"], json.loads(arguments) if isinstance(arguments, str) else arguments))
    return (message.get("content") or "").strip(), calls


def _finish_reason(choice: Choice, args: GeneratingArguments) -> str:
    if choice.message.get("tool_calls"):
        return "tool_calls"
    return "length" if not choice.sample.stopped and len(choice.sample.ids) >= args.max_new_tokens else "stop"


def unknown_session(session_id: str) -> ApiError:
    """The error of a call naming no open session (never opened, or its episode ended)."""
    return ApiError(
        404, f"no open session {session_id!r}: its episode ended or was never started", "session", "unknown_session"
    )
