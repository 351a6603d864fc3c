"""The text environment contract (GEM's `gem.Env`) and the checks of what an environment returns.

An environment is any object with these two methods (a `gem.Env` is one):

    reset(seed: int | None = None) -> (observation: str, info: dict)
    step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)

- `reset(seed)` starts an episode. The same seed gives the same episode (the members of a GRPO group
  share one), `None` a random one. The observation is the first user turn (the task).
- `step(action)` takes the policy's decoded text for one turn and returns the next observation, the
  turn's reward, and whether the episode ended: `terminated` by the task itself (solved, failed),
  `truncated` by a limit outside it (the environment's turn limit, an error). After either, the caller
  resets before stepping again.
- `info` carries per-turn metrics: its numeric values (bool, int, float) are averaged or summed by the
  trackers, everything else is ignored by them. The keys below have fixed meanings; an environment
  sets those that apply to it.
- `close()` is optional: callers call it when they drop an environment that has one.
- `tool_schemas()` is optional: the OpenAI-style function schemas of the tools the environment answers (a
  `tools.ToolEnv` has it). With `env.apply_chat_template`, the rollout passes them to the chat template's
  `tools`, which lists them in the first observation.
- An observation may also be a list of content parts, text and images (`Observation`), for a vision-language
  policy: the rollout renders it as the policy's processor does and keeps the images with the episode.

Environments are used from one thread at a time, but not always the same thread (the manager's
threads), so they keep their random state in themselves (`random.Random(seed)`), never in the
process-wide generators.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Text, or (for a vision-language policy) a list of content parts: `{"type": "text", "text": ...}` and
# `{"type": "image", "image": <PIL image, path or bytes>}`, as in an OpenAI/HF chat message.
Observation = str | list[dict[str, Any]]
ResetResult = tuple[Observation, dict[str, Any]]
StepResult = tuple[Observation, float, bool, bool, dict[str, Any]]

# info keys with a fixed meaning.
SUCCESS = "success"  # 1.0 or 0.0 on the turn that ends an episode: whether the task was solved
INVALID_ACTION = "invalid_action"  # 1 when the turn's action could not be read (the turn is still spent)
TOOL_CALLS = "tool_calls"  # tool calls made this turn (tools.ToolEnv)
TOOL_SUCCESSES = "tool_successes"  # of them, the calls that returned a result rather than an error
OBSERVATION_ROLE = "observation_role"  # "tool" when the observation is a tool's output, else absent (user)
ENV_ERROR = "env_error"  # 1 when the environment raised, hung or returned garbage (manager.EnvManager)
ENV_ERROR_MESSAGE = "env_error_message"  # what went wrong, for the logs


@runtime_checkable
class Env(Protocol):
    """A text environment: `reset(seed) -> (observation, info)`, `step(action) -> (obs, reward, terminated,
    truncated, info)`; see the module docstring for the contract."""

    def reset(self, seed: int | None = None) -> ResetResult:
        """Start an episode; return its first observation and info."""
        ...

    def step(self, action: str) -> StepResult:
        """Act with the policy's text; return (observation, reward, terminated, truncated, info)."""
        ...


class InvalidEnvOutput(TypeError):
    """An environment's reset or step returned something outside the protocol."""


def checked_reset(result: object) -> ResetResult:
    """`result` of a reset as `(str, dict)`; InvalidEnvOutput when it has another shape or types."""
    observation, info = _unpack(result, 2, "reset", "(observation, info)")
    return _observation(observation, "reset"), _info(info, "reset")


def checked_step(result: object) -> StepResult:
    """`result` of a step as `(str, float, bool, bool, dict)` of Python types (numpy scalars converted);
    InvalidEnvOutput when it has another shape, other types or a reward that is not finite."""
    observation, reward, terminated, truncated, info = _unpack(
        result, 5, "step", "(observation, reward, terminated, truncated, info)"
    )
    # A bool reward is most likely a misplaced flag.
    if not isinstance(reward, numbers.Real) or isinstance(reward, (bool, np.bool_)) or not math.isfinite(reward):
        raise InvalidEnvOutput(f"step returned the reward {_describe(reward)}, not a finite number")
    flags = []
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, (bool, np.bool_)):
            raise InvalidEnvOutput(f"step returned {name}={_describe(flag)}, not a bool")
        flags.append(bool(flag))
    return _observation(observation, "step"), float(reward), flags[0], flags[1], _info(info, "step")


def _unpack(result: object, size: int, call: str, shape: str) -> tuple[Any, ...]:
    if not isinstance(result, (tuple, list)) or len(result) != size:
        raise InvalidEnvOutput(f"{call} must return {shape}, not {_describe(result)}")
    return tuple(result)


def _observation(observation: object, call: str) -> Observation:
    if isinstance(observation, str):
        return observation
    parts_ok = isinstance(observation, list) and all(
        isinstance(part, dict)
        and (
            (part.get("type") == "text" and isinstance(part.get("text"), str))
            or (part.get("type") == "image" and part.get("image") is not None)
        )
        for part in observation
    )
    if not parts_ok:
        raise InvalidEnvOutput(
            f"{call} returned the observation {_describe(observation)}, not a str or a list of "
            '{"type": "text", "text": ...} and {"type": "image", "image": ...} parts'
        )
    return list(observation)


def observation_text(observation: Observation) -> str:
    """An observation as text for logs and transcripts: its text parts, each image as `<image>`."""
    if isinstance(observation, str):
        return observation
    return "".join(part["text"] if part["type"] == "text" else "<image>" for part in observation)


def _info(info: object, call: str) -> dict[str, Any]:
    if not isinstance(info, dict):
        raise InvalidEnvOutput(f"{call} returned the info {_describe(info)}, not a dict")
    return dict(info)


def _describe(value: object) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"
