"""SIGTERM and SIGINT as a request to stop at the next step boundary with a checkpoint, within a deadline.

SLURM (`--signal`), Kubernetes (pod deletion) and a user's Ctrl-C all send one of them before the process is
killed. The first one sets `StopSignals.requested`; the driver loop checks it after every step, checkpoints and
raises `Preempted`, and the entry point exits with PREEMPTED_EXIT_CODE. If the process has not exited within the
deadline, it exits then with the same status, with or without that checkpoint: the last complete one stays usable,
as after any crash mid-save. A second SIGINT interrupts at once (KeyboardInterrupt), as Ctrl-C does without roll.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

from roll.utils.console import MILESTONE

logger = logging.getLogger(__name__)

# EX_TEMPFAIL of sysexits.h: "try again later". scripts/deploy/slurm_ray.sbatch requeues on it.
PREEMPTED_EXIT_CODE = 75
CAUGHT = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped on a stop signal after checkpointing at `step` (`checkpoint` None: it had nothing to save)."""

    def __init__(self, step: int, checkpoint: str | None) -> None:
        saved = f"checkpoint {checkpoint} written" if checkpoint else "no new step to checkpoint"
        super().__init__(f"stopped on a signal after step {step} ({saved})")
        self.step = step
        self.checkpoint = checkpoint


class StopSignals:
    """Catches SIGTERM and SIGINT in the driver: the first asks the run to stop, a second SIGINT interrupts."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.received: int | None = None  # the first signal's number
        self.received_at = 0.0
        self._watchdog: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.received is not None

    def install(self) -> None:
        """Handle the signals from now on (again after `ray.init`, which sets its own SIGTERM handler); main thread
        only."""
        for signum in CAUGHT:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        """Give the signals back to their handlers from before `install`, and stop the deadline's watchdog."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received, self.received_at = signum, time.monotonic()
        logger.warning(
            "%s received: the run stops after its current step with a checkpoint (deadline %.0f s); a second "
            "Ctrl-C interrupts at once",
            signal.Signals(signum).name,
            self.deadline_s,
            extra=MILESTONE,
        )
        self._watchdog = threading.Timer(self.deadline_s, self._deadline_passed)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _deadline_passed(self) -> None:
        print(
            f"run preempted: not stopped within fault_tolerance.preemption_deadline_s={self.deadline_s:g} s of the "
            "signal; exiting now. Resume with resume_from_checkpoint=latest (the last complete checkpoint).",
            file=sys.stderr,
            flush=True,
        )
        os._exit(PREEMPTED_EXIT_CODE)
