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
    # two resets in the manager's threads at once would interleave and lose the seed's determinism.
    _reset_lock = threading.Lock()

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        check_gem_id(env_id)
        from gem import make

        self.env_id = env_id
        self.env = make(env_id, **kwargs)

    def reset(self, seed: int | None = None) -> ResetResult:
        """GEM's reset, under the lock that keeps its seeding deterministic."""
        with self._reset_lock:
            return checked_reset(self.env.reset(seed=seed))

    def step(self, action: str) -> StepResult:
        """GEM's step."""
        return checked_step(self.env.step(action))

    def close(self) -> None:
        """GEM's close, when the environment has one."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()
