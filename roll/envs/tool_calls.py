"""Tool calls in an action's text: the Hermes/Qwen JSON format and a compact bracket format for tiny models.

- `hermes`: `<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>`, what Qwen's
  and Hermes' chat templates teach (`arguments` may also be a JSON string of that object).
- `bracket`: `[calc 12*34]`, an opening delimiter, the tool's name (lowercase letters, digits, `_`),
  one space, the argument, the closing delimiter. It needs only the delimiters, lowercase letters, a
  space and the argument's own characters, so a character-level model with a small vocabulary can
  emit it; the argument cannot contain the closing delimiter.

A call that starts but is malformed (bad JSON, no closing tag) is still a call, with `error` set, so
the wrapper answers it with the error rather than passing the text to the environment.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

HERMES = "hermes"
BRACKET = "bracket"
FORMATS = (HERMES, BRACKET)

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (a dict from JSON, the raw text from brackets).

    `error` says why a call that was started could not be read; the call is then answered with it.
    """

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(
    text: str, formats: Sequence[str] = FORMATS, brackets: tuple[str, str] = ("[", "]")
) -> list[ToolCall]:
    """The tool calls in `text`, in the order they appear, in the given formats; [] when it makes none."""
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"unknown tool-call formats {sorted(unknown)}; known: {', '.join(FORMATS)}")
    found: list[tuple[int, ToolCall]] = []
    if HERMES in formats:
        found += [(m.start(), _hermes_call(m.group(1), closed=bool(m.group(2)))) for m in _HERMES.finditer(text)]
    if BRACKET in formats:
        opening, closing = map(re.escape, brackets)
        pattern = re.compile(rf"{opening}([a-z][a-z0-9_]*) (.*?)({closing}|$)", re.DOTALL)
        found += [(m.start(), _bracket_call(m, brackets[1])) for m in pattern.finditer(text)]
    return [call for _, call in sorted(found, key=lambda item: item[0])]


def _hermes_call(body: str, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall("", error="malformed tool call: no </tool_call>")
    try:
        call = json.loads(body)
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return ToolCall("", error=f"malformed tool call: invalid JSON ({exc})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
        return ToolCall("", error='malformed tool call: expected {"name": "...", "arguments": {...}}')
    return ToolCall(call["name"], arguments)


def _bracket_call(match: re.Match[str], closing: str) -> ToolCall:
    name, argument, end = match.groups()
    if not end:
        return ToolCall(name, argument, error=f"malformed tool call: no closing {closing!r}")
    return ToolCall(name, argument)
