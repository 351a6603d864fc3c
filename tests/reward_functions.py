"""Reward functions that misbehave, for the tests of reward isolation."""

from __future__ import annotations

import time


def flaky_reward(prompt: str, response: str, answer: str) -> float:
    """Raises on answers ending in 3, hangs on answers ending in 7, else exact match."""
    if answer.endswith("3"):
        raise RuntimeError("this reward function is broken for answers ending in 3")
    if answer.endswith("7"):
        time.sleep(60)
    return 1.0 if response.strip() == answer else 0.0


def parity_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 for responses of even length: a signal even an untrained model's samples disagree on."""
    return float(len(response) % 2 == 0)
