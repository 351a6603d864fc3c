"""Ending Ray actors so that their processes exit normally, with a kill as the fallback."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray

from roll.utils.process_exit import skip_teardown_at_exit

logger = logging.getLogger(__name__)


def end_actors(actors: Sequence[ray.actor.ActorHandle], timeout_s: float = 10) -> None:
    """Ask every actor to exit, and kill those that have not within `timeout_s`.

    `ray.kill` ends a process at once, so its `atexit` handlers never run: whatever a library flushes at exit
    (a tracker's last metrics, a profiler's or coverage.py's data) is lost. A normal exit runs them; it waits
    behind the actor's running call, hence the deadline and the kill after it. The exit skips the interpreter's
    teardown of the process's objects (roll.utils.process_exit), about a CPU-second of a worker's.
    """
    exits = [actor.__ray_call__.remote(_exit_without_teardown) for actor in actors]
    _, still_running = ray.wait(exits, num_returns=len(exits), timeout=timeout_s)
    for actor, exit_ref in zip(actors, exits, strict=True):
        if exit_ref in still_running:
            logger.warning("an actor did not exit within %.0f s; killing it", timeout_s)
            ray.kill(actor, no_restart=True)


def _exit_without_teardown(_instance: object) -> None:
    """Run in an actor (`__ray_call__`): end it as `__ray_terminate__` does, its process skipping the teardown."""
    skip_teardown_at_exit()
    ray.actor.exit_actor()
