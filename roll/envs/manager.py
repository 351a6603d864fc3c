"""Many environments reset and stepped together in threads, with a concurrency cap and a per-call timeout.

Pure Python, no Ray: the driver uses it directly for cheap games, and an env worker holds one. Each
slot holds one environment built by the factory. A call that raises, outlives its timeout or returns
something outside the protocol ends that slot's episode as truncated (info `env_error` = 1 and
`env_error_message`), is logged and counted in `error_counts`; the other slots of the batch go on.

A failed environment is discarded and never used again: a hung one may still be running in its
abandoned daemon thread (see `deadline`), and one that raised may be half-updated. It is closed (its
`close()`, when it has one) in a daemon thread of its own that nothing waits for: a hung environment's
`close()` runs while its call may still run, and is how it frees what it holds (a subprocess, a lock).
The slot builds a fresh environment at its next reset, inside that reset's timeout.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll.envs.deadline import Outcome, run_with_deadline
from roll.envs.protocol import (
    ENV_ERROR,
    ENV_ERROR_MESSAGE,
    Env,
    InvalidEnvOutput,
    Observation,
    checked_reset,
    checked_step,
)
from roll.utils.imports import exception_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvResult:
    """One environment's answer to a reset (reward 0, not done unless it failed) or a step."""

    observation: Observation
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """Whether the episode has ended: stop stepping this slot until it is reset."""
        return self.terminated or self.truncated


class EnvManager:
    """`num_envs` slots of environments made by `factory()`, reset and stepped in batches of slots.

    At most `max_concurrency` calls run at once, each given `timeout_s` seconds from its start (a reset
    that builds the slot's environment includes the build).
    """

    def __init__(
        self, factory: Callable[[], Env], num_envs: int, max_concurrency: int = 8, timeout_s: float = 30.0
    ) -> None:
        if num_envs < 1 or max_concurrency < 1 or timeout_s <= 0:
            raise ValueError(
                f"num_envs ({num_envs}) and max_concurrency ({max_concurrency}) must be at least 1 "
                f"and timeout_s ({timeout_s}) positive"
            )
        self._factory = factory
        self._envs: list[Env | None] = [None] * num_envs
        self._in_episode = [False] * num_envs
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.error_counts: Counter[str] = Counter()  # by kind: raised, timeout, invalid_output

    @property
    def num_envs(self) -> int:
        """How many slots the manager holds."""
        return len(self._envs)

    def reset(self, seeds: Sequence[int | None], slots: Sequence[int] | None = None) -> list[EnvResult]:
        """Reset `slots` (default: the first len(seeds)) with `seeds`; one result per slot, in order."""
        slots = self._slots(slots, len(seeds))
        built: dict[int, Env] = {}  # environments built by this reset, to close when their reset fails

        def call(slot: int, seed: int | None) -> tuple[Env, EnvResult]:
            env = self._envs[slot]
            if env is None:
                env = built[slot] = self._factory()
            observation, info = checked_reset(env.reset(seed))
            return env, EnvResult(observation, info=info)

        outcomes = self._run(
            "reset", [lambda s=s, seed=seed: call(s, seed) for s, seed in zip(slots, seeds, strict=True)]
        )
        results = []
        for slot, outcome in zip(slots, outcomes, strict=True):
            if outcome.ok:
                self._envs[slot], result = outcome.value
                self._in_episode[slot] = True
            else:
                _close_abandoned(self._envs[slot] or built.get(slot))
                result = self._fail(slot, "reset", outcome)
            results.append(result)
        return results

    def step(self, actions: Sequence[str], slots: Sequence[int] | None = None) -> list[EnvResult]:
        """Step `slots` (default: the first len(actions)) with `actions`; one result per slot, in order.

        ValueError when a slot has no running episode: it was never reset, or its last result was done.
        """
        slots = self._slots(slots, len(actions))
        idle = [slot for slot in slots if not self._in_episode[slot]]
        if idle:
            raise ValueError(f"slots {idle} have no running episode: reset them first, and stop at a done result")

        def call(env: Env, action: str) -> EnvResult:
            return EnvResult(*checked_step(env.step(action)))

        envs = [self._envs[slot] for slot in slots]
        outcomes = self._run("step", [lambda e=e, a=a: call(e, a) for e, a in zip(envs, actions, strict=True)])
        results = []
        for slot, env, outcome in zip(slots, envs, outcomes, strict=True):
            if not outcome.ok:
                _close_abandoned(env)
            result = outcome.value if outcome.ok else self._fail(slot, "step", outcome)
            self._in_episode[slot] = not result.done
            results.append(result)
        return results

    def close(self) -> None:
        """Close every live environment that has a `close()`, each within the timeout; failures are logged."""
        live = [(slot, env) for slot, env in enumerate(self._envs) if env is not None and hasattr(env, "close")]
        outcomes = self._run("close", [env.close for _, env in live])
        for (slot, _), outcome in zip(live, outcomes, strict=True):
            if not outcome.ok:
                logger.warning("environment %d: close failed: %s", slot, _reason(outcome, self.timeout_s)[1])
        self._envs = [None] * self.num_envs
        self._in_episode = [False] * self.num_envs

    def _slots(self, slots: Sequence[int] | None, count: int) -> list[int]:
        return checked_slots(slots, count, self.num_envs)

    def _run(self, call: str, calls: list[Callable[[], Any]]) -> list[Outcome[Any]]:
        return run_with_deadline(calls, self.timeout_s, self.max_concurrency, name=f"roll-env-{call}")

    def _fail(self, slot: int, call: str, outcome: Outcome[Any]) -> EnvResult:
        """Discard the slot's environment and end its episode as truncated, logged and counted."""
        kind, reason = _reason(outcome, self.timeout_s)
        self.error_counts[kind] += 1
        self._envs[slot] = None
        self._in_episode[slot] = False
        message = f"{call} {reason}"
        logger.warning("environment %d: %s; its episode is truncated and the environment discarded", slot, message)
        return failed_result(message)


def _close_abandoned(env: Env | None) -> None:
    """Close a failed environment in a daemon thread nothing waits for (its call may still be running)."""
    close = getattr(env, "close", None)
    if callable(close):
        threading.Thread(target=_close_quietly, args=(close,), name="roll-env-close-failed", daemon=True).start()


def _close_quietly(close: Callable[[], Any]) -> None:
    try:
        close()
    except Exception as exc:  # a broken environment may fail to close too: logged, never raised
        logger.warning("closing a failed environment raised %s", exception_line(exc))


def failed_result(message: str) -> EnvResult:
    """The result of a call that failed: the episode ends as truncated, with `env_error` and its message."""
    return EnvResult("", truncated=True, info={ENV_ERROR: 1, ENV_ERROR_MESSAGE: message})


def checked_slots(slots: Sequence[int] | None, count: int, num_envs: int) -> list[int]:
    """`slots` (default: the first `count`) as a list; ValueError unless `count` distinct slots of `num_envs`."""
    slots = list(range(count)) if slots is None else list(slots)
    if len(slots) != count:
        raise ValueError(f"{len(slots)} slots for {count} seeds or actions")
    if len(set(slots)) != len(slots) or not all(0 <= slot < num_envs for slot in slots):
        raise ValueError(f"slots must be distinct and in [0, {num_envs}): {slots}")
    return slots


def _reason(outcome: Outcome[Any], timeout_s: float) -> tuple[str, str]:
    """(kind, message) of a failed outcome."""
    if outcome.timed_out:
        return "timeout", f"did not return within {timeout_s:g}s"
    if isinstance(outcome.error, InvalidEnvOutput):
        return "invalid_output", f"returned garbage: {outcome.error}"
    return "raised", f"raised {exception_line(outcome.error)}"
