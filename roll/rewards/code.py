"""The code reward: run a response's Python program against the answer's test cases in the code sandbox.

The answer is JSON, in one of the two shapes code datasets use: standard input and expected output
(APPS, CodeContests, TACO: `{"inputs": [...], "outputs": [...]}`), or assertions run after the
program (MBPP, HumanEval: `{"tests": ["assert add(1, 2) == 3", ...]}`). Each test case is its own
sandboxed run, so a program cannot tamper with the outcome of another case.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from roll.rewards.code_sandbox import Limits, run_python

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

# Per test case. Several cases run one after another inside the reward's own deadline
# (rewards.<name>.timeout_s), which should exceed cases x time_s.
CODE_LIMITS = Limits(time_s=2.0, memory_mb=512, output_bytes=1 << 20, processes=16)


def extract_code(response: str) -> str:
    """The last fenced code block of `response`, or the whole response when it has none."""
    blocks = CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else response


def _same_output(actual: str, expected: str) -> bool:
    """Equal line by line, ignoring trailing whitespace and trailing blank lines."""
    return [line.rstrip() for line in actual.rstrip().splitlines()] == [
        line.rstrip() for line in expected.rstrip().splitlines()
    ]


def parse_test_cases(answer: str) -> list[tuple[str, str, str | None]]:
    """(code to append, stdin, expected stdout or None) per case of a JSON `answer`; ValueError when malformed."""
    try:
        spec = json.loads(answer)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the answer of a code sample must be JSON test cases: {exc}") from exc
    if isinstance(spec, dict) and "tests" in spec:
        return [(f"\n\n{test}\n", "", None) for test in spec["tests"]]
    if isinstance(spec, dict) and "inputs" in spec and len(spec["inputs"]) == len(spec.get("outputs", ())):
        return [("", str(stdin), str(stdout)) for stdin, stdout in zip(spec["inputs"], spec["outputs"], strict=True)]
    raise ValueError('code test cases are {"inputs": [...], "outputs": [...]} or {"tests": ["assert ...", ...]}')


def make_code_reward(limits: Limits) -> Callable[[str, str, str], float]:
    """A code reward whose every test case runs under `limits` (a module of yours can define its own)."""

    def reward(prompt: str, response: str, answer: str) -> float:
        """The fraction of the answer's test cases the response's program passes."""
        cases = parse_test_cases(answer)
        program = extract_code(response)
        passed = 0
        for suffix, stdin, expected in cases:
            result = run_python(program + suffix, stdin, limits)
            ok = result.returncode == 0 and not result.timed_out
            passed += ok and (expected is None or _same_output(result.stdout, expected))
        return passed / len(cases) if cases else 0.0

    return reward


code_reward = make_code_reward(CODE_LIMITS)
