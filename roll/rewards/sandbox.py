"""What runs inside a reward worker's child process; kept free of heavy imports so restarts are quick."""

from __future__ import annotations

from collections.abc import Callable

from roll.utils.imports import import_object

_reward_fn: Callable[[str, str, str], float] | None = None


def import_reward_fn(dotted: str) -> Callable[[str, str, str], float]:
    """The function a dotted path `package.module.function` names; ValueError when it cannot be imported."""
    fn = import_object(dotted, "reward_fn")
    if not callable(fn):
        raise ValueError(f"reward_fn {dotted!r} is not callable")
    return fn


def load_reward_fn(dotted: str) -> None:
    """Pool initializer: import the reward function once per child process."""
    global _reward_fn
    _reward_fn = import_reward_fn(dotted)


def score(prompt: str, response: str, answer: str) -> float:
    """Score one sample with the loaded reward function."""
    return float(_reward_fn(prompt, response, answer))  # type: ignore[misc]
