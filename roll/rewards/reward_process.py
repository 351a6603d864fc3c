"""A reward function run in a child process: a batch of samples goes over in one message, each sample's
score comes back on its own, each with a deadline.

The child side (`serve`) is kept free of heavy imports so that restarts are quick. Parent and child
talk over a pipe and nothing else: a `multiprocessing.Pool` owns six named semaphores, registered
with multiprocessing's resource tracker and removed only by exit-time finalizers. Ray kills a
worker's child processes, the tracker among them, before the worker's Python exits (or kills the
worker outright), so those semaphores were either unregistered with a fresh tracker that never knew
them (six `KeyError: '/mp-...'` tracebacks at the end of a run) or left in /dev/shm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from roll.utils.imports import import_object

_reward_fns: dict[str, Callable[[str, str, str], float]] = {}

Sample = tuple[str, str, str]  # (prompt, response, answer)
# What a child sends once its reward functions are imported; a sample's deadline starts after it.
READY = "ready"
# How long a new child may take to import the reward functions' modules (a user's may import torch).
START_TIMEOUT_S = 300.0


class RewardFunctionError(Exception):
    """The reward function raised, or its process died, on one sample."""


def import_reward_fn(dotted: str) -> Callable[[str, str, str], float]:
    """The function a dotted path `package.module.function` names; ValueError when it cannot be imported."""
    fn = import_object(dotted, "reward_fn")
    if not callable(fn):
        raise ValueError(f"reward_fn {dotted!r} is not callable")
    return fn


def load_reward_fns(dotted: Sequence[str]) -> None:
    """Import the reward functions once per child process."""
    global _reward_fns
    _reward_fns = {path: import_reward_fn(path) for path in dotted}


def score(prompt: str, response: str, answer: str) -> list[float]:
    """Score one sample with each loaded reward function; RewardFunctionError names the one that raised."""
    scores = []
    for path, fn in _reward_fns.items():
        try:
            scores.append(float(fn(prompt, response, answer)))
        except Exception as exc:  # any failure of user code is the parent's to count
            raise RewardFunctionError(f"{path}: {type(exc).__name__}: {exc}") from exc
    return scores


def serve(conn: Connection, dotted: Sequence[str]) -> None:
    """Child process: import the functions, send READY, then for each batch of samples received on `conn`, send
    one reply per sample, in order: `(True, scores)` or `(False, error)`.

    Returns when the parent closes its end of the pipe.
    """
    load_reward_fns(dotted)
    conn.send(READY)
    while True:
        try:
            samples = conn.recv()
        except EOFError:
            return
        for sample in samples:
            try:
                reply: tuple[bool, list[float] | str] = (True, score(*sample))
            except RewardFunctionError as exc:
                reply = (False, str(exc))
            conn.send(reply)


class _ChildLost(Exception):
    """The child hung or died on a sample; `error` is that sample's outcome."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Scorer:
    """The parent side: one child process running the reward functions, replaced when it hangs or dies.

    A sample's score is the weighted sum of the functions' scores (weights default to 1 each); when one
    of them raises, the sample fails as a whole.
    """

    def __init__(self, context: BaseContext, reward_fn: str | Sequence[str], weights: Sequence[float] = ()) -> None:
        self._context = context
        self._reward_fns = (reward_fn,) if isinstance(reward_fn, str) else tuple(reward_fn)
        self._weights = tuple(weights) or (1.0,) * len(self._reward_fns)
        if len(self._weights) != len(self._reward_fns):
            raise ValueError(f"{len(self._reward_fns)} reward functions but {len(self._weights)} weights")
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        parent_conn, child_conn = self._context.Pipe()
        self._process = self._context.Process(
            target=serve, args=(child_conn, self._reward_fns), name="reward-scorer", daemon=True
        )
        self._process.start()
        child_conn.close()
        self._conn = parent_conn
        # Importing the functions' modules is not a sample's time: on a busy machine it could take longer than
        # timeout_s, and every sample would then fail on a child that never got to score.
        try:
            ready = parent_conn.recv() if parent_conn.poll(START_TIMEOUT_S) else None
        except (EOFError, OSError):
            ready = None
        if ready != READY:
            exitcode = self._stop(grace_s=0)
            raise RuntimeError(
                f"the reward scoring process did not import {', '.join(self._reward_fns)} within "
                f"{START_TIMEOUT_S:.0f} s (exit code {exitcode})"
            )

    def score_all(self, samples: Sequence[Sample], timeout_s: float) -> list[float | Exception]:
        """Each sample's score, or the exception that stands for it: TimeoutError when it took longer than
        `timeout_s`, RewardFunctionError when the function raised or its process died.

        The samples go over in one message: a round trip per sample cost more than scoring a short answer.
        A hung or dead child is replaced and the samples after the one it failed on are sent again.
        """
        outcomes: list[float | Exception] = []
        while len(outcomes) < len(samples):
            if self._process is not None and not self._process.is_alive():
                self._stop(grace_s=0)  # died between batches: no sample of this batch to blame
            if self._process is None:
                self._start()
            pending = samples[len(outcomes) :]
            try:
                self._send(pending)
                for _ in pending:
                    outcomes.append(self._receive(timeout_s))
            except _ChildLost as lost:
                outcomes.append(lost.error)
        return outcomes

    def _send(self, samples: Sequence[Sample]) -> None:
        """Send a batch; _ChildLost (blaming its first sample) when the child is gone."""
        try:
            self._conn.send(list(samples))
        except OSError:
            raise self._died(grace_s=0) from None

    def _receive(self, timeout_s: float) -> float | Exception:
        """The next sample's outcome; _ChildLost when the child hung or died on it (it is then stopped)."""
        try:
            reply = self._conn.recv() if self._conn.poll(timeout_s) else None
        except (EOFError, OSError):
            raise self._died(grace_s=1.0) from None
        if reply is None:
            self._stop(grace_s=0)  # stuck in user code
            raise _ChildLost(TimeoutError(f"took longer than {timeout_s} s"))
        ok, value = reply
        if not ok:
            return RewardFunctionError(value)
        return sum(weight * term for weight, term in zip(self._weights, value, strict=True))

    def _died(self, grace_s: float) -> _ChildLost:
        """Stop what is left of a dead child; the outcome of the sample it died on."""
        exitcode = self._stop(grace_s)
        return _ChildLost(RewardFunctionError(f"the scoring process died (exit code {exitcode})"))

    def _stop(self, grace_s: float) -> int | None:
        """Close the pipe, wait `grace_s` for the child to exit, else kill it; its exit code."""
        if self._process is None:
            return None
        self._conn.close()  # the child's recv ends: a healthy child returns from serve
        self._process.join(grace_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        exitcode = self._process.exitcode
        self._process.close()
        self._process = None
        return exitcode

    def close(self) -> None:
        """Stop the child process (it exits on its own within a second, else it is killed)."""
        self._stop(grace_s=1.0)
