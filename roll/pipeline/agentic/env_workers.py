"""The env role: environments held by CPU Ray actors instead of the driver (`env.num_env_workers > 0`).

`EnvWorkers` answers like an `EnvManager` (`num_envs`, `reset`, `step`, `close`), so the multi-turn rollout
uses either. It splits a batch's slots into contiguous blocks, one per actor, and each actor runs an
`EnvManager` over its block with the config's concurrency cap and per-call timeout; the actors work at once.

An actor that dies, or does not answer within its block's time (each of its call waves may take the timeout,
plus `ACTOR_GRACE_S`), ends the episodes of all its slots as truncated with an env error, is killed, and is
replaced at its next reset: the run goes on. The actors ask Ray for no CPU (`num_cpus=0`): they mostly wait
for the policy, and the model roles' placement groups may hold every CPU of the node.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from roll.envs.manager import EnvManager, EnvResult, checked_slots, failed_result
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.utils.fileio import write_pid_file

logger = logging.getLogger(__name__)

# Seconds an actor's answer may take beyond its environments' own timeouts (Ray's call and transfer overhead).
ACTOR_GRACE_S = 30.0
# Seconds a new actor may take to start (a Ray worker process importing roll and the environment's module); it is
# waited for before its first reset, whose timeout then counts from when the actor is up.
ACTOR_START_TIMEOUT_S = 300.0


class EnvActor:
    """One env worker: an `EnvManager` over `num_envs` environments built from the `env` block."""

    def __init__(self, env: EnvArguments, num_envs: int) -> None:
        self.manager = EnvManager(env.make_env, num_envs, env.max_concurrency, env.timeout_s)
        write_pid_file(f"env-{os.getpid()}")  # a replaced actor is another process: each has its own file

    def ready(self) -> bool:
        """Whether the actor is up: answered once its process has started and built its manager."""
        return True

    def reset(self, seeds: list[int | None], slots: list[int]) -> list[EnvResult]:
        """The manager's reset of `slots`."""
        return self.manager.reset(seeds, slots)

    def step(self, actions: list[str], slots: list[int]) -> list[EnvResult]:
        """The manager's step of `slots`."""
        return self.manager.step(actions, slots)

    def close(self) -> None:
        """Close the manager's environments."""
        self.manager.close()


_REMOTE_ENV_ACTOR = ray.remote(num_cpus=0)(EnvActor)


def actors_up(started: dict[int, Any], what: str) -> dict[int, Any]:
    """Of the actors just `started` (by slot index), those that answer `ready` within `ACTOR_START_TIMEOUT_S`; the
    others are killed, and a warning names each as `what` and its index."""
    ready = {index: actor.ready.remote() for index, actor in started.items()}
    up = {}
    for index, actor in started.items():
        try:
            ray.get(ready[index], timeout=ACTOR_START_TIMEOUT_S)
            up[index] = actor
        except (RayActorError, GetTimeoutError) as exc:
            logger.warning("%s %d did not start (%s): %s", what, index, type(exc).__name__, exc)
            ray.kill(actor)
    return up


class EnvWorkers:
    """`num_envs` environment slots spread over `env.num_env_workers` Ray actors (fewer when slots are fewer)."""

    def __init__(self, env: EnvArguments, num_envs: int) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs ({num_envs}) must be at least 1")
        self.env = env
        count = min(env.num_env_workers, num_envs)
        sizes = [num_envs // count + (i < num_envs % count) for i in range(count)]
        self._starts = [sum(sizes[:i]) for i in range(count)]
        self._sizes = sizes
        self._actors: list[Any] = [None] * count

    @property
    def num_envs(self) -> int:
        """How many slots the workers hold together."""
        return sum(self._sizes)

    def reset(self, seeds: Sequence[int | None], slots: Sequence[int] | None = None) -> list[EnvResult]:
        """Reset `slots` (default: the first len(seeds)) with `seeds`; a replaced actor is started first."""
        return self._call("reset", list(seeds), slots)

    def step(self, actions: Sequence[str], slots: Sequence[int] | None = None) -> list[EnvResult]:
        """Step `slots` (default: the first len(actions)) with `actions`."""
        return self._call("step", list(actions), slots)

    def close(self) -> None:
        """Close the environments and end the actors; an actor that fails to close is killed anyway."""
        for index, actor in enumerate(self._actors):
            if actor is None:
                continue
            try:
                ray.get(actor.close.remote(), timeout=self.env.timeout_s + ACTOR_GRACE_S)
            except (RayActorError, GetTimeoutError) as exc:
                logger.warning("env worker %d: close failed: %s", index, exc)
            ray.kill(actor)
        self._actors = [None] * len(self._actors)

    def _actor_of(self, slot: int) -> int:
        return max(i for i, start in enumerate(self._starts) if start <= slot)

    def _call(self, method: str, items: list[Any], slots: Sequence[int] | None) -> list[EnvResult]:
        """Send each actor its slots' share of `items`, wait for all, and put the answers back in slot order."""
        slots = checked_slots(slots, len(items), self.num_envs)
        shares: dict[int, list[int]] = {}
        for position, slot in enumerate(slots):
            shares.setdefault(self._actor_of(slot), []).append(position)
        if method == "reset":
            self._start_actors([index for index in shares if self._actors[index] is None])
        calls = {}
        for index, positions in shares.items():
            actor = self._actors[index]
            local = [slots[p] - self._starts[index] for p in positions]
            if actor is not None:
                calls[index] = getattr(actor, method).remote([items[p] for p in positions], local)
        results: list[EnvResult | None] = [None] * len(slots)
        for index, positions in shares.items():
            answers = self._answers(index, calls.get(index), method, len(positions))
            for position, answer in zip(positions, answers, strict=True):
                results[position] = answer
        return [result for result in results if result is not None]

    def _start_actors(self, indices: list[int]) -> None:
        """Start the actors `indices` and wait until they are up (`ACTOR_START_TIMEOUT_S`), so their start-up does
        not count inside the first reset's timeout. One that does not come up is killed and left out: the reset
        ends its slots' episodes as failed."""
        started = {index: _REMOTE_ENV_ACTOR.remote(self.env, self._sizes[index]) for index in indices}
        for index, actor in actors_up(started, "env worker").items():
            self._actors[index] = actor

    def _answers(self, index: int, call: Any, method: str, count: int) -> list[EnvResult]:
        """Actor `index`'s answers to `call`, or `count` failed results when it died, hung or was already gone."""
        if call is None:
            return [failed_result(f"{method}: env worker {index} is not running (lost, or it did not start)")] * count
        waves = math.ceil(count / self.env.max_concurrency)
        try:
            return ray.get(call, timeout=waves * self.env.timeout_s + ACTOR_GRACE_S)
        except (RayActorError, GetTimeoutError) as exc:
            message = f"{method}: env worker {index} failed ({type(exc).__name__}); it is replaced at the next reset"
            logger.warning("%s: %s", message, exc)
            ray.kill(self._actors[index])
            self._actors[index] = None
            return [failed_result(message)] * count
