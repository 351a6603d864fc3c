"""calculator_arithmetic: multiply two 2-3 digit numbers, with the calculator tool a tiny model needs for it.

The observation is the problem, `123*45=?`; an action `[calc 123*45]` (or a Hermes `<tool_call>`) is
answered by the calculator, any other action is the answer: its last number counts, reward 1 when it is
the product, 0 when not (terminated either way, `correct` or `wrong`). An answer without a number is
`invalid`, counted in `invalid_action`; after `max_turns` answers the episode is truncated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from roll.envs.builtin.text import last_integer
from roll.envs.protocol import INVALID_ACTION, SUCCESS, ResetResult, StepResult
from roll.envs.registry import register_env
from roll.envs.tool_calls import FORMATS
from roll.envs.tools import ToolEnv


class MultiplicationEnv:
    """`a*b=?` for operands of `min_digits` to `max_digits` digits drawn from the seed; answered once."""

    def __init__(self, min_digits: int = 2, max_digits: int = 3, max_turns: int = 2) -> None:
        if not 1 <= min_digits <= max_digits or max_turns < 1:
            raise ValueError(f"need 1 <= min_digits ({min_digits}) <= max_digits ({max_digits}), max_turns >= 1")
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.max_turns = max_turns
        self.operands = (0, 0)
        self.turns = 0

    def reset(self, seed: int | None = None) -> ResetResult:
        """A new problem from `seed`."""
        rng = random.Random(seed)
        digits = [rng.randint(self.min_digits, self.max_digits) for _ in range(2)]
        self.operands = tuple(rng.randint(10 ** (d - 1), 10**d - 1) for d in digits)
        self.turns = 0
        return f"{self.operands[0]}*{self.operands[1]}=?", {}

    def step(self, action: str) -> StepResult:
        """Score the action's answer."""
        self.turns += 1
        answer = last_integer(action)
        if answer is None:
            truncated = self.turns >= self.max_turns
            return "invalid", 0.0, False, truncated, {INVALID_ACTION: 1, **({SUCCESS: 0.0} if truncated else {})}
        correct = answer == self.operands[0] * self.operands[1]
        return (
            ("correct" if correct else "wrong"),
            float(correct),
            True,
            False,
            {INVALID_ACTION: 0, SUCCESS: float(correct)},
        )


@register_env("calculator_arithmetic")
def calculator_arithmetic(
    min_digits: int = 2,
    max_digits: int = 3,
    max_turns: int = 2,
    formats: Sequence[str] = FORMATS,
    tool_timeout_s: float = 2.0,
    brackets: tuple[str, str] = ("<", ">"),
) -> ToolEnv:
    """The multiplication task with the `calc` tool, parsed in `formats` (bracket and Hermes by default).

    The bracket calls default to `<calc 12*34>`: the tiny models' character vocabulary has `<` and `>`, not `[`.
    """
    task = MultiplicationEnv(min_digits, max_digits, max_turns)
    return ToolEnv(task, ("calc",), formats, tool_timeout_s, tuple(brackets))


def tool_use_rows(
    seeds: Sequence[int], tool_share: float, eos: str, min_digits: int = 2, max_digits: int = 3, system: str = ""
) -> list[dict[str, str]]:
    """SFT rows of calculator_arithmetic episodes as the multi-turn rollout tokenises them without a chat template.

    The first `round(tool_share * len(seeds))` problems are solved with the tool: a row asking for the call
    `<calc a*b>`, then a row whose prompt holds the call, `eos` as text and the tool's answer, asking for the
    product. The others are answered directly with the product, which a tiny model cannot compute: the warm
    start knows both moves and leaves RL to find that the tool pays. A `system` prompt goes first, on a line of its
    own, as the agent endpoint renders an agent's system message without a chat template.
    """
    rows = []
    env = MultiplicationEnv(min_digits, max_digits)
    with_tool = round(tool_share * len(seeds))
    for index, seed in enumerate(seeds):
        observation, _ = env.reset(seed)
        a, b = env.operands
        prompt = (f"{system}\n" if system else "") + observation + "\n"
        if index < with_tool:
            call = f"<calc {a}*{b}>"
            rows.append({"prompt": prompt, "answer": call})
            prompt += f"{call}{eos}{a * b}\n"
        rows.append({"prompt": prompt, "answer": str(a * b)})
    return rows
