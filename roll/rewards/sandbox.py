"""A reward function run in a child process, one sample at a time, each with a deadline.

The child side (`serve`) is kept free of heavy imports so that restarts are quick. Parent and child
talk over a pipe and nothing else: a `multiprocessing.Pool` owns six named semaphores, registered
with multiprocessing's resource tracker and removed only by exit-time finalizers. Ray kills a
worker's child processes, the tracker among them, before the worker's Python exits (or kills the
worker outright), so those semaphores were either unregistered with a fresh tracker that never knew
them (six `KeyError: '/mp-...'` tracebacks at the end of a run) or left in /dev/shm.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from roll.utils.imports import import_object

_reward_fn: Callable[[str, str, str], float] | None = None

Sample = tuple[str, str, str]  # (prompt, response, answer)


class RewardFunctionError(Exception):
    """The reward function raised, or its process died, on one sample."""


def import_reward_fn(dotted: str) -> Callable[[str, str, str], float]:
    """The function a dotted path `package.module.function` names; ValueError when it cannot be imported."""
    fn = import_object(dotted, "reward_fn")
    if not callable(fn):
        raise ValueError(f"reward_fn {dotted!r} is not callable")
    return fn


def load_reward_fn(dotted: str) -> None:
    """Import the reward function once per child process."""
    global _reward_fn
    _reward_fn = import_reward_fn(dotted)


def score(prompt: str, response: str, answer: str) -> float:
    """Score one sample with the loaded reward function."""
    return float(_reward_fn(prompt, response, answer))  # type: ignore[misc]


def serve(conn: Connection, dotted: str) -> None:
    """Child process: answer each sample received on `conn` with `(True, score)` or `(False, error)`.

    Returns when the parent closes its end of the pipe.
    """
    load_reward_fn(dotted)
    while True:
        try:
            sample = conn.recv()
        except EOFError:
            return
        try:
            reply: tuple[bool, float | str] = (True, score(*sample))
        except Exception as exc:  # any failure of user code is the parent's to count
            reply = (False, f"{type(exc).__name__}: {exc}")
        conn.send(reply)


class Scorer:
    """The parent side: one child process running `reward_fn`, replaced when it hangs or dies."""

    def __init__(self, context: BaseContext, reward_fn: str) -> None:
        self._context = context
        self._reward_fn = reward_fn
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        parent_conn, child_conn = self._context.Pipe()
        self._process = self._context.Process(
            target=serve, args=(child_conn, self._reward_fn), name="reward-scorer", daemon=True
        )
        self._process.start()
        child_conn.close()
        self._conn = parent_conn

    def score(self, sample: Sample, timeout_s: float) -> float:
        """The score of one sample; TimeoutError past `timeout_s`, RewardFunctionError when the function fails."""
        if self._process is None:
            self._start()
        try:
            self._conn.send(sample)
            reply = self._conn.recv() if self._conn.poll(timeout_s) else None
        except (EOFError, OSError) as exc:
            exitcode = self._stop(grace_s=1.0)
            raise RewardFunctionError(f"the scoring process died (exit code {exitcode})") from exc
        if reply is None:
            self._stop(grace_s=0)  # stuck in user code
            raise TimeoutError(f"took longer than {timeout_s} s")
        ok, value = reply
        if not ok:
            raise RewardFunctionError(value)
        return value

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
