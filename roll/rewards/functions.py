"""Rule-based rewards. A reward function maps (prompt, response, answer) to a score in [0, 1]."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from functools import lru_cache

RewardFunction = Callable[[str, str, str], float]

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
GSM8K_MARK = "####"
PLAIN_INTEGER = re.compile(r"-?\d{1,18}")


def final_answer(text: str) -> str:
    """Where `text` states its final answer: inside its last `<answer>` tag, after GSM8K's last `####`, else all of it.

    math-verify then reads the last `\\boxed{}` of what is left, or its last number or expression.
    """
    tagged = ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    if GSM8K_MARK in text:
        return text.rpartition(GSM8K_MARK)[2]
    return text


def math_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final answer equals `answer`'s mathematically (math-verify), else 0.0.

    `answer` may be a bare value, a GSM8K solution ending in `#### N`, or a MATH solution with `\\boxed{}`.
    """
    gold_text, predicted_text = final_answer(answer).strip(), final_answer(response).strip()
    if PLAIN_INTEGER.fullmatch(gold_text) and PLAIN_INTEGER.fullmatch(predicted_text):
        # Two bare integers, which math-verify would read as exactly these: compared without parsing (a
        # parse and verify cost milliseconds, most of a small model's RL step when every sample is scored).
        return 1.0 if int(gold_text) == int(predicted_text) else 0.0
    from math_verify import verify

    # math-verify's own timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = _math_parse(gold_text, timeout)
    predicted = _math_parse(predicted_text, timeout)
    return 1.0 if gold and predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0


class _Unparsed(Exception):
    """math-verify found nothing: maybe a parse that timed out, so it is not cached."""


@lru_cache(maxsize=8192)
def _cached_parse(text: str, timeout: int | None) -> list:
    from math_verify import parse

    parsed = parse(text, parsing_timeout=timeout)
    if not parsed:
        raise _Unparsed
    return parsed


def _math_parse(text: str, timeout: int | None) -> list:
    """math-verify's parse of `text`, cached: a group's samples share their answer and often their response,
    and a parse costs milliseconds (sympy), the whole reward of a short response."""
    try:
        return _cached_parse(text, timeout)
    except _Unparsed:
        return []


def exact_match_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the stripped response is exactly `answer`."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def format_reward_for(pattern: str) -> RewardFunction:
    """A format reward: 1.0 when the whole stripped response matches the regular expression `pattern`, else 0.0.

    For markup of your own, define `my_format = format_reward_for(r"...")` in a module of yours and name
    it in `reward_fn`.
    """
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompt: str, response: str, answer: str) -> float:
        """1.0 when the response has the expected markup."""
        return 1.0 if compiled.fullmatch(response.strip()) else 0.0

    return reward


# The markups in common use; the response must end with its answer.
answer_tag_format_reward = format_reward_for(r"(?:(?!<answer>).)*<answer>(?:(?!</?answer>).)+</answer>")
think_answer_format_reward = format_reward_for(
    r"<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)+</answer>"
)
boxed_format_reward = format_reward_for(r".*\\boxed\{.+\}[\s.$]*")
gsm8k_format_reward = format_reward_for(r".*####\s*-?[\d,]+(?:\.\d+)?")
