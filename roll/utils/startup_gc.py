"""Python's cyclic garbage collector, deferred while a process starts.

A roll process starts by importing torch, transformers and roll's strategies: several hundred thousand objects that
live as long as the process, and almost no garbage. CPython's collector still walks all of them in a full collection
each time the tracked objects grow by a quarter, about a fifth of the imports' CPU time. `import roll` therefore
raises the youngest generation's threshold (`defer_collection`: a collection after DEFERRED_THRESHOLD allocations
instead of CPython's 700, so the older generations' turns come that much later too), and a process puts CPython's
thresholds back where its start-up ends (`end_startup`): a Ray worker in its constructor, a driver in its pipeline's
constructor, a test session after collection. A process that imports roll and does neither keeps the
deferred threshold. `ROLL_DEFER_GC=0` leaves the collector as CPython sets it. The measurements are in
docs/performance.md.
"""

from __future__ import annotations

import gc
import os

DEFERRED_THRESHOLD = 50_000
_thresholds_before: tuple[int, int, int] | None = None


def defer_collection() -> None:
    """Collect the youngest generation every DEFERRED_THRESHOLD allocations until `end_startup`."""
    global _thresholds_before
    if os.environ.get("ROLL_DEFER_GC", "1") == "0" or _thresholds_before is not None or not gc.isenabled():
        return
    thresholds = gc.get_threshold()
    if thresholds[0] < DEFERRED_THRESHOLD:
        _thresholds_before = thresholds
        gc.set_threshold(DEFERRED_THRESHOLD, *thresholds[1:])


def end_startup() -> None:
    """Put the collector's thresholds back as they were before `defer_collection` (nothing if not deferred)."""
    global _thresholds_before
    if _thresholds_before is not None:
        gc.set_threshold(*_thresholds_before)
        _thresholds_before = None
