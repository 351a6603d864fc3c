"""Bring your own environment: unit conversion with a `convert` tool (docs/agentic.md, "Bring your own environment").

The task is a question such as `how many m are 7 km?`. The policy may call the `convert` tool, which the
prompt lists (its schema goes to the chat template's `tools`), in the Hermes format a Qwen2.5 model writes:

    <tool_call>{"name": "convert", "arguments": {"query": "7 km to m"}}</tool_call>

or in the bracket form `<convert 7 km to m>` a character-level tiny model can spell. The tool's answer
(`7000 m`) comes back as a tool turn; an action without a call is the answer: reward 1 when its last number is
the exact value, 0 otherwise, and the episode ends either way.

roll finds it by its dotted path: with this folder on the PYTHONPATH, `env.name: unit_conversion.unit_conversion`
builds the environment with `env.kwargs` as keyword arguments.
"""

from __future__ import annotations

import random
import re

from roll.envs import Tool, ToolEnv
from roll.envs.protocol import INVALID_ACTION, SUCCESS

# Each dimension's units and their size in its smallest unit. Questions convert to a smaller unit, so that
# every answer is a whole number.
UNITS = {
    "length": {"mm": 1, "cm": 10, "m": 1000, "km": 1_000_000},
    "mass": {"g": 1, "kg": 1000, "t": 1_000_000},
    "time": {"s": 1, "min": 60, "h": 3600, "d": 86_400},
}
SIZE = {unit: (dimension, size) for dimension, units in UNITS.items() for unit, size in units.items()}
QUERY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s+(?:to|in)\s+([a-z]+)\s*$")


def convert(query: str) -> str:
    """The tool: `7 km to m` -> `7000 m`. A ValueError is shown to the policy as `error: <message>`."""
    match = QUERY.match(query.lower())
    if not match:
        raise ValueError("ask as '<amount> <unit> to <unit>', e.g. '7 km to m'")
    amount, source, target = match.groups()
    if source not in SIZE or target not in SIZE:
        raise ValueError(f"unknown unit; units: {', '.join(SIZE)}")
    if SIZE[source][0] != SIZE[target][0]:
        raise ValueError(f"cannot convert {SIZE[source][0]} to {SIZE[target][0]}")
    value = float(amount) * SIZE[source][1] / SIZE[target][1]
    return f"{value:g} {target}" if value != int(value) else f"{int(value)} {target}"


CONVERT = Tool(
    name="convert",
    argument="query",  # the one text argument: {"query": "7 km to m"} in a Hermes call
    run=convert,
    description="Convert an amount between units of length, mass or time, e.g. '7 km to m' gives '7000 m'.",
)


class UnitConversionTask:
    """The task without the tool: a question from the seed, and the answer scored. The protocol is two methods."""

    def __init__(self, max_amount: int = 99, max_turns: int = 2) -> None:
        self.max_amount = max_amount
        self.max_turns = max_turns
        self.answer = 0
        self.turns = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        rng = random.Random(seed)  # the episode's own generator: the same seed asks the same question
        units = UNITS[rng.choice(sorted(UNITS))]
        source, target = sorted(rng.sample(sorted(units), 2), key=units.get, reverse=True)
        amount = rng.randint(1, self.max_amount)
        self.answer, self.turns = amount * units[source] // units[target], 0
        return f"how many {target} are {amount} {source}?", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turns += 1
        numbers = re.findall(r"\d+", action)
        if not numbers:  # no answer: try again, until the turns run out
            out_of_turns = self.turns >= self.max_turns
            return "answer with a number", 0.0, False, out_of_turns, {INVALID_ACTION: 1}
        correct = int(numbers[-1]) == self.answer
        return ("correct" if correct else "wrong"), float(correct), True, False, {SUCCESS: float(correct)}


def unit_conversion(max_amount: int = 99, max_turns: int = 2, tool_timeout_s: float = 2.0) -> ToolEnv:
    """What `env.name` names: the task wrapped with the tool. ToolEnv answers actions that call `convert` and passes
    the others to the task; its `tool_schemas()` are what the rollout gives the chat template."""
    return ToolEnv(UnitConversionTask(max_amount, max_turns), [CONVERT], timeout_s=tool_timeout_s, brackets=("<", ">"))
