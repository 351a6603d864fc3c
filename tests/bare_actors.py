"""Actors for the cluster tests whose module imports only the standard library: the Ray worker process that hosts
one starts without importing torch, transformers or roll (seconds of CPU the tests do not need)."""

from __future__ import annotations

import os
import time


class Sleeper:
    """An actor whose call outlasts the exit deadline."""

    def sleep(self, seconds: float) -> None:
        """Return after `seconds`."""
        time.sleep(seconds)


class Peer:
    """One side of a collective: it dies, or fails as gloo does once its peer is gone."""

    def ready(self) -> None:
        """Answers once the actor runs."""

    def die_after(self, seconds: float) -> None:
        """End the actor's process after `seconds`, as a crash does."""
        time.sleep(seconds)
        os._exit(1)

    def lose_peer(self) -> None:
        """Fail with gloo's error for a peer that is gone."""
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4736")
