"""The OpenAI chat-completions wire format of the agent endpoint: requests checked into `ChatRequest`, errors as
OpenAI's JSON error bodies, and the assistant's text turned into a response message with its tool calls.

Only what roll serves is accepted: `messages`, `tools`, `tool_choice`, `n`, `temperature`, `top_p`, `max_tokens`
(or `max_completion_tokens`), `stop`, `seed`, plus fields clients send that change nothing here (`model`,
`stream: false`, `user`, ...). A field that would change sampling in a way roll does not (`logit_bias`,
`stream: true`, ...) is an error rather than silently ignored.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from roll.envs.tool_calls import BRACKET, HERMES, ToolCall, parse_tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
# Sent by common clients, with nothing to change in roll's answer.
IGNORED_FIELDS = ("model", "user", "metadata", "store", "parallel_tool_calls", "stream_options", "logprobs")
SAMPLING_FIELDS = ("n", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed")
KNOWN_FIELDS = {"messages", "tools", "tool_choice", "stream", *SAMPLING_FIELDS, *IGNORED_FIELDS}
MAX_CHOICES = 16


class ApiError(Exception):
    """A request roll answers with an OpenAI-style error: HTTP `status`, `message`, its `type`, `param`, `code`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's API returns for an error."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request; `max_tokens` None means the endpoint's cap."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


def parse_chat_request(body: Any) -> ChatRequest:
    """`body` (parsed JSON) as a `ChatRequest`; `ApiError` naming the field that is wrong."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise invalid(f"unsupported parameter(s) {unknown}; roll serves {sorted(KNOWN_FIELDS)}", unknown[0])
    if body.get("stream"):
        raise invalid("stream=true is not supported by roll's training endpoint", "stream")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(_is_function_tool(tool) for tool in tools):
        raise invalid("'tools' must be a list of {'type': 'function', 'function': {'name': ...}}", "tools")
    return ChatRequest(
        messages=[_message(message, i) for i, message in enumerate(messages)],
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice", "auto"), tools),
        n=_number(body, "n", int, 1, MAX_CHOICES) or 1,
        temperature=_number(body, "temperature", float, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 0.0, 1.0),
        max_tokens=_number(body, "max_tokens", int, 1, None) or _number(body, "max_completion_tokens", int, 1, None),
        stop=_stop(body.get("stop")),
        seed=_number(body, "seed", int, 0, 2**32 - 1),
    )


def _is_function_tool(tool: Any) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type", "function") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


def _message(message: Any, index: int) -> dict[str, Any]:
    """One message normalised for the chat template: text content, tool-call arguments as objects."""
    param = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise invalid(f"{param} must be an object with a 'role' among {list(ROLES)}", param)
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise invalid(f"{param}.content: only text parts are supported", f"{param}.content")
        content = "".join(str(part.get("text", "")) for part in content)
    if content is not None and not isinstance(content, str):
        raise invalid(f"{param}.content must be a string, a list of text parts or null", f"{param}.content")
    role = "system" if message["role"] == "developer" else message["role"]
    normalised: dict[str, Any] = {"role": role, "content": content or ""}
    if role == "assistant" and message.get("tool_calls"):
        normalised["tool_calls"] = [
            _tool_call(call, f"{param}.tool_calls[{i}]") for i, call in enumerate(message["tool_calls"])
        ]
    if role == "tool" and message.get("tool_call_id") is not None:
        normalised["tool_call_id"] = str(message["tool_call_id"])
    return normalised


def _tool_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(f"{param} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param)
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise invalid(f"{param}.function.arguments is not JSON ({exc})", param) from exc
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str:
    if choice in ("auto", "none") or (choice == "required" and tools):
        return str(choice)
    raise invalid("tool_choice: roll serves 'auto', 'none' and (with tools) 'required'", "tool_choice")


def _number(body: dict[str, Any], name: str, kind: type, low: float, high: float | None) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise invalid(f"'{name}' must be a number{' (an integer)' if kind is int else ''}", name)
    if value < low or (high is not None and value > high):
        raise invalid(f"'{name}'={value} is out of range [{low}, {high if high is not None else 'inf'}]", name)
    return kind(value)


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return tuple(stops)


def assistant_message(text: str, request: ChatRequest, brackets: tuple[str, str] | None) -> dict[str, Any]:
    """The response message of the sampled `text`: Hermes `<tool_call>` blocks (and, with `brackets`, the bracket
    form `<calc 12*34>` of a requested tool, its text the tool's first parameter) become OpenAI tool calls when the
    request has tools; what is left is the content. A malformed call stays in the content."""
    if not request.tools or request.tool_choice == "none":
        return {"role": "assistant", "content": text}
    names = {tool["function"]["name"]: tool["function"] for tool in request.tools}
    formats = (HERMES, BRACKET) if brackets else (HERMES,)
    calls = [call for call in parse_tool_calls(text, formats, brackets or ("[", "]")) if _is_call_of(call, names)]
    if not calls:
        return {"role": "assistant", "content": text}
    content = _without_calls(text, brackets)
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [_openai_call(call, names[call.name]) for call in calls],
    }


def _is_call_of(call: ToolCall, names: dict[str, Any]) -> bool:
    return call.error is None and call.name in names


def _without_calls(text: str, brackets: tuple[str, str] | None) -> str:
    text = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL)
    if brackets:
        opening, closing = map(re.escape, brackets)
        text = re.sub(rf"{opening}[a-z][a-z0-9_]* .*?{closing}", "", text, flags=re.DOTALL)
    return text.strip()


def _openai_call(call: ToolCall, function: dict[str, Any]) -> dict[str, Any]:
    arguments = call.arguments
    if isinstance(arguments, str):  # the bracket form's text: the tool's first parameter
        properties = list((function.get("parameters") or {}).get("properties") or {}) or ["input"]
        arguments = {properties[0]: arguments}
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(arguments)},
    }


def completion_body(
    choices: list[tuple[dict[str, Any], str]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The chat.completion response of `choices` (message, finish_reason) with its token usage."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "roll-policy",
        "choices": [
            {"index": i, "message": message, "finish_reason": reason, "logprobs": None}
            for i, (message, reason) in enumerate(choices)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
