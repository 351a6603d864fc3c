"""Calls run in daemon threads, a few at a time, each abandoned at its deadline.

Python cannot kill a thread. A call still running at its deadline is abandoned: nothing waits for it
any longer, its thread keeps running until the call returns (if ever), and as a daemon thread it does
not hold the interpreter at exit. Whatever the call was working on must never be used again (the
manager discards the environment). `concurrent.futures.ThreadPoolExecutor` cannot do this: its
threads are joined at exit, so one hung call would hang the process's shutdown.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """How one call ended: its value, the exception it raised, or `timed_out` (abandoned at its deadline)."""

    value: T | None = None
    error: BaseException | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Whether the call returned."""
        return self.error is None and not self.timed_out


def run_with_deadline(
    calls: Sequence[Callable[[], T]], timeout_s: float, max_concurrency: int, name: str = "roll-call"
) -> list[Outcome[T]]:
    """Run `calls`, at most `max_concurrency` at once, each in a daemon thread of its own given `timeout_s` from
    its start; return their outcomes in order. Returns once every call has returned, raised or been abandoned."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, not {max_concurrency}")
    outcomes: list[Outcome[T] | None] = [None] * len(calls)
    # One queue per batch: a call abandoned here that returns later puts its outcome where no one reads.
    finished: queue.SimpleQueue[tuple[int, Outcome[T]]] = queue.SimpleQueue()
    waiting = deque(range(len(calls)))
    deadlines: dict[int, float] = {}

    def run(index: int) -> None:
        try:
            finished.put((index, Outcome(value=calls[index]())))
        except BaseException as exc:  # anything the call raises is its outcome
            finished.put((index, Outcome(error=exc)))

    while waiting or deadlines:
        while waiting and len(deadlines) < max_concurrency:
            index = waiting.popleft()
            deadlines[index] = time.monotonic() + timeout_s
            threading.Thread(target=run, args=(index,), name=f"{name}-{index}", daemon=True).start()
        try:
            index, outcome = finished.get(timeout=max(0.0, min(deadlines.values()) - time.monotonic()))
            if deadlines.pop(index, None) is not None:  # else abandoned already: it came too late
                outcomes[index] = outcome
        except queue.Empty:
            now = time.monotonic()
            for index in [index for index, deadline in deadlines.items() if deadline <= now]:
                del deadlines[index]
                outcomes[index] = Outcome(timed_out=True)
    return outcomes  # type: ignore[return-value]  # every slot is filled above
