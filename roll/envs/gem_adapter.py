"""GEM's environments (the `gem-llm` package) behind roll's protocol, imported only when one is asked for."""

from __future__ import annotations

import difflib
import logging
import threading
from typing import Any

from roll.envs.protocol import ResetResult, StepResult, checked_reset, checked_step


def gem_registry() -> dict[str, Any]:
    """GEM's registered environments by id (`gem.envs.registration.ENV_REGISTRY`)."""
    # `import gem` calls logging.basicConfig(level=INFO), which would turn on every library's INFO logs.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        from gem.envs.registration import ENV_REGISTRY
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return ENV_REGISTRY


def check_gem_id(env_id: str, field: str = "env") -> None:
    """ValueError naming `field` when GEM has no environment `env_id`, with the closest ids."""
    registry = gem_registry()
    if env_id not in registry:
        close = difflib.get_close_matches(env_id, list(registry), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else " (gem.print_envs() lists them)"
        raise ValueError(f"{field} 'gem:{env_id}' is not a GEM environment id{hint}")


class GemEnv:
    """A GEM environment, `gem.make(env_id, **kwargs)`, whose results are checked and made Python types."""

    # GEM's reset(seed) seeds the process-wide `random` and numpy generators and then draws from them:
    # two resets in the manager's threads at once would interleave and lose the seed's determinism. A reset
    # abandoned at its timeout still holds the lock in its thread: closing its environment (as the manager does
    # with a failed one) gives the class a fresh lock, and waiters on the old one move to it.
    _reset_lock = threading.Lock()
    _reset_holder: GemEnv | None = None  # the environment whose reset holds `_reset_lock`
    _state = threading.Lock()  # guards the two above

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        check_gem_id(env_id)
        from gem import make

        self.env_id = env_id
        self.env = make(env_id, **kwargs)

    def reset(self, seed: int | None = None) -> ResetResult:
        """GEM's reset, under the lock that keeps its seeding deterministic."""
        lock = self._acquire_reset_lock()
        try:
            return checked_reset(self.env.reset(seed=seed))
        finally:
            with GemEnv._state:
                if GemEnv._reset_holder is self:
                    GemEnv._reset_holder = None
            lock.release()

    def step(self, action: str) -> StepResult:
        """GEM's step."""
        return checked_step(self.env.step(action))

    def close(self) -> None:
        """GEM's close, when the environment has one; a reset of this environment still running is abandoned:
        the reset lock it holds is replaced, so other environments' resets go on."""
        with GemEnv._state:
            if GemEnv._reset_holder is self:
                GemEnv._reset_lock, GemEnv._reset_holder = threading.Lock(), None
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _acquire_reset_lock(self) -> threading.Lock:
        """The class's current reset lock, acquired; a lock replaced while waiting is left for the new one."""
        while True:
            lock = GemEnv._reset_lock
            if not lock.acquire(timeout=_LOCK_POLL_S):
                continue
            with GemEnv._state:
                if lock is GemEnv._reset_lock:
                    GemEnv._reset_holder = self
                    return lock
            lock.release()


# How often a reset waiting for the reset lock checks whether the lock was replaced.
_LOCK_POLL_S = 0.05
