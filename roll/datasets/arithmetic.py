"""A synthetic verifiable task: small-number arithmetic with a held-out split.

Every problem `a op b` with operands in `[0, max_operand]` is generated once, shuffled with a fixed
seed and split, so held-out problems are never seen in training (neither in SFT nor in RL).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    """One verifiable example: the prompt shown to the model and the answer a reward checks."""

    prompt: str
    answer: str
    domain: str = "math"
    # The demonstrated response (SFT); empty: the answer alone.
    demonstration: str = ""


def arithmetic_problems(
    max_operand: int = 19, operations: str = "+-", held_out_fraction: float = 0.2, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """All `a op b = ?` problems, split into (train, held_out) deterministically by `seed`."""
    unknown = set(operations) - set(OPERATIONS)
    if unknown:
        raise ValueError(f"unknown operation(s) {sorted(unknown)}; use some of {''.join(OPERATIONS)}")
    problems = [
        Problem(prompt=f"{a}{op}{b}=", answer=str(OPERATIONS[op](a, b)))
        for op in operations
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]
    random.Random(seed).shuffle(problems)
    held_out = max(1, int(len(problems) * held_out_fraction))
    return problems[held_out:], problems[:held_out]


def two_steps(expression: str, partial: int, third: int, total: int) -> list[str]:
    """The two steps of `expression + third` worked out: `expression=partial`, then `partial+third=total`."""
    return [f"{expression}={partial}", f"{partial}+{third}={total}"]


def two_step_problems(problems: list[Problem], seed: int) -> list[Problem]:
    """Each problem `a op b=` extended to `a op b+c=` (c in [0, 19], seeded), answered by the total and
    demonstrated as its two steps, each on a line of its own (`two_steps`)."""
    rng = random.Random(seed + 3)  # a stream of its own: the other built-in sets start theirs from `seed`
    extended = []
    for problem in problems:
        expression, third = problem.prompt[:-1], rng.randint(0, 19)
        total = int(problem.answer) + third
        steps = two_steps(expression, int(problem.answer), third, total)
        extended.append(
            Problem(f"{expression}+{third}=", str(total), problem.domain, "".join(step + "\n" for step in steps))
        )
    return extended


def wrong_answers(problems: list[Problem], max_offset: int = 5, seed: int = 0) -> list[str]:
    """One wrong answer per problem, the correct one off by 1 to `max_offset` either way (seeded, so fixed)."""
    rng = random.Random(seed)
    offsets = [o for o in range(-max_offset, max_offset + 1) if o]
    return [str(int(p.answer) + rng.choice(offsets)) for p in problems]
