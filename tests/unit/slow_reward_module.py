"""A reward function whose module takes 2 s to import (tests/unit/test_reward_process.py)."""

import time

time.sleep(2)


def exact(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response is the answer."""
    return float(response == answer)
