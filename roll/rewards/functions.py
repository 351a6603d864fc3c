"""Rule-based rewards. A reward function maps (prompt, response, answer) to a score in [0, 1]."""

from __future__ import annotations

import threading
from collections.abc import Callable

RewardFunction = Callable[[str, str, str], float]


def math_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final answer equals `answer` mathematically (math-verify), else 0.0."""
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=timeout)
    predicted = parse(response, parsing_timeout=timeout)
    return 1.0 if gold and predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0


def exact_match_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the stripped response is exactly `answer`."""
    return 1.0 if response.strip() == answer.strip() else 0.0
