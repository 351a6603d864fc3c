"""The tool-calling wrapper: an action that calls tools gets their results as its observation.

`ToolEnv(env, tools)` parses each action for tool calls (`tool_calls`: the Hermes/Qwen JSON format and
the bracket format). An action with calls runs them, each within `timeout_s`, and answers with their
results (or `error: <why>`) joined by newlines, as a tool observation (info `observation_role` =
"tool"); the inner environment never sees that action, and the turn's reward is 0. An action without
calls goes to the inner environment. Every turn's info counts `tool_calls` and `tool_successes`.
A call past its timeout is abandoned in its daemon thread (see `deadline`), so tools keep no state
between calls.

A tool is one function of one text argument returning text. It refuses by raising ValueError (the
message is shown as it is); any other exception is shown with its type. Built-in tools: `calc` (safe
integer arithmetic) and `python` (a program run in roll's code sandbox, its stdout the result).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from roll.envs.calculator import calculate
from roll.envs.deadline import Outcome, run_with_deadline
from roll.envs.protocol import (
    OBSERVATION_ROLE,
    TOOL_CALLS,
    TOOL_SUCCESSES,
    Env,
    ResetResult,
    StepResult,
    checked_reset,
    checked_step,
)
from roll.envs.tool_calls import FORMATS, ToolCall, parse_tool_calls
from roll.rewards.code_sandbox import Limits
from roll.utils.imports import import_object


class ToolError(ValueError):
    """A tool's refusal or failure; the policy sees `error: <message>`."""


@dataclass(frozen=True)
class Tool:
    """A tool: its name, the name of its one text argument in JSON calls, and the function computing its result."""

    name: str
    argument: str
    run: Callable[[str], str]
    description: str = ""

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render (`apply_chat_template(..., tools=[...])`)."""
        parameters = {
            "type": "object",
            "properties": {self.argument: {"type": "string"}},
            "required": [self.argument],
        }
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }


# The sandbox's runner forks with a preexec_fn, which is unsafe in a process with threads (the manager's
# and this wrapper's): it runs in a fresh, single-threaded interpreter instead.
_SANDBOX_CHILD = """
import dataclasses, json, sys
from roll.rewards.code_sandbox import Limits, run_python
job = json.load(sys.stdin)
json.dump(dataclasses.asdict(run_python(job["code"], "", Limits(**job["limits"]))), sys.stdout)
"""


def run_code(code: str, limits: Limits, max_output_chars: int = 1000) -> str:
    """The stdout of the Python program `code` run in the code sandbox under `limits`; ToolError when it fails."""
    job = json.dumps({"code": code, "limits": dataclasses.asdict(limits)})
    child = subprocess.run(
        [sys.executable, "-c", _SANDBOX_CHILD], input=job, capture_output=True, text=True, timeout=limits.time_s + 30
    )
    if child.returncode != 0:
        raise RuntimeError(f"the sandbox failed: {_last_line(child.stderr)}")
    result = json.loads(child.stdout)
    if result["timed_out"]:
        raise ToolError(f"timed out after {limits.time_s:g}s")
    if result["returncode"] != 0:
        raise ToolError(_last_line(result["stderr"]) or f"exit code {result['returncode']}")
    return result["stdout"][:max_output_chars].rstrip()


def python_tool(limits: Limits | None = None, max_output_chars: int = 1000) -> Tool:
    """The `python` tool: runs a program in the code sandbox under `limits` and answers with its stdout."""
    limits = limits or Limits(time_s=5.0, memory_mb=256)
    run = functools.partial(run_code, limits=limits, max_output_chars=max_output_chars)
    return Tool("python", "code", run, "Run a Python program; the result is what it prints.")


CALCULATOR = Tool("calc", "expression", calculate, "Integer arithmetic: + - * / // % ** and parentheses.")
BUILTIN_TOOLS = {tool.name: tool for tool in (CALCULATOR, python_tool())}


def resolve_tool(spec: str | Tool, field: str = "tools") -> Tool:
    """A built-in tool's name, a dotted path to a `Tool`, or a `Tool`; ValueError naming `field` otherwise."""
    if isinstance(spec, Tool):
        return spec
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    if "." in spec:
        tool = import_object(spec, field)
        if isinstance(tool, Tool):
            return tool
        raise ValueError(f"{field} {spec!r} is a {type(tool).__name__}, not a roll.envs.tools.Tool")
    raise ValueError(f"{field} {spec!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) or a dotted path to a Tool")


class ToolEnv:
    """`env` with `tools`: actions calling tools are answered by the tools, the others go to `env`.

    `formats` are the call formats parsed (`hermes`, `bracket`), `brackets` the bracket format's
    delimiters, `timeout_s` each call's wall-clock limit (the python tool's sandbox start-up included),
    `max_calls_per_turn` how many calls of one action run (the others are answered with an error).
    """

    def __init__(
        self,
        env: Env,
        tools: Sequence[str | Tool] = ("calc",),
        formats: Sequence[str] = FORMATS,
        timeout_s: float = 10.0,
        brackets: tuple[str, str] = ("[", "]"),
        max_calls_per_turn: int = 4,
    ) -> None:
        resolved = [resolve_tool(tool) for tool in tools]
        self.tools = {tool.name: tool for tool in resolved}
        if len(self.tools) != len(resolved):
            raise ValueError(f"tool names must be distinct: {[tool.name for tool in resolved]}")
        parse_tool_calls("", formats, brackets)  # checks the formats
        self.env = env
        self.formats = tuple(formats)
        self.brackets = tuple(brackets)
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' function schemas, for a chat template's `tools` argument."""
        return [tool.schema() for tool in self.tools.values()]

    def reset(self, seed: int | None = None) -> ResetResult:
        """The inner environment's reset."""
        return checked_reset(self.env.reset(seed))

    def step(self, action: str) -> StepResult:
        """Run the action's tool calls, or step the inner environment when it makes none."""
        calls = parse_tool_calls(action, self.formats, self.brackets)
        if not calls:
            observation, reward, terminated, truncated, info = checked_step(self.env.step(action))
            return observation, reward, terminated, truncated, {**info, TOOL_CALLS: 0, TOOL_SUCCESSES: 0}
        limit = self.max_calls_per_turn
        calls = calls[:limit] + [ToolCall("", error=f"at most {limit} tool calls per turn")] * (len(calls) - limit)
        outcomes = run_with_deadline(
            [functools.partial(self._call, call) for call in calls], self.timeout_s, len(calls), name="roll-tool"
        )
        answers = [self._answer(outcome) for outcome in outcomes]
        info = {TOOL_CALLS: len(calls), TOOL_SUCCESSES: sum(o.ok for o in outcomes), OBSERVATION_ROLE: "tool"}
        return "\n".join(answers), 0.0, False, False, info

    def close(self) -> None:
        """Close the inner environment when it has a `close()`."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _call(self, call: ToolCall) -> str:
        if call.error:
            raise ToolError(call.error)
        tool = self.tools.get(call.name)
        if tool is None:
            raise ToolError(f"unknown tool {call.name!r} (tools: {', '.join(self.tools)})")
        if isinstance(call.arguments, str):
            return tool.run(call.arguments)
        if tool.argument not in call.arguments:
            raise ToolError(f'{tool.name} takes {{"{tool.argument}": ...}}, not {sorted(call.arguments)}')
        return tool.run(str(call.arguments[tool.argument]))

    def _answer(self, outcome: Outcome[str]) -> str:
        if outcome.ok:
            return str(outcome.value)
        if outcome.timed_out:
            return f"error: timed out after {self.timeout_s:g}s"
        error = outcome.error
        return f"error: {error}" if isinstance(error, ValueError) else f"error: {type(error).__name__}: {error}"


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""
