"""Restarting a run whose worker or node died: which checkpoint it resumes from, how long it waits, what it logs.

The entry point stops every role on a WorkerDiedError; with restarts left (`fault_tolerance.max_restarts`), it
starts the pipeline again in the same process from the last complete checkpoint, with the reservation's timeout
set to `fault_tolerance.recovery_timeout_s`. A cluster that has lost a node refuses the roles at once; the entry
point tries again every few seconds until the node is back (or another takes its place) or that time has passed
since the fault, and then ends the run with the death's message.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from roll.pipeline.base import checkpoint_state
from roll.pipeline.base.pipeline_config import PipelineConfig
from roll.utils.console import MILESTONE

logger = logging.getLogger(__name__)

PLACEMENT_RETRY_S = 5.0  # between two tries to place the restarted roles on a cluster that lost a node


class Restarts:
    """The restarts of one run: how many are left, the config each resumes with, the metrics they add."""

    def __init__(self, config: PipelineConfig) -> None:
        fault_tolerance = getattr(config, "fault_tolerance", None)
        self.max_restarts = fault_tolerance.max_restarts if fault_tolerance else 0
        self.recovery_timeout_s = fault_tolerance.recovery_timeout_s if fault_tolerance else 0.0
        self.done = 0
        self.fault_at = 0.0  # when the last restart began, every role stopped (time.monotonic)

    @property
    def left(self) -> bool:
        """Whether another restart is allowed."""
        return self.done < self.max_restarts

    def next_config(self, config: PipelineConfig, fault: BaseException) -> PipelineConfig:
        """Count a restart after `fault` and log it; the config that resumes from this run's last complete
        checkpoint (the one it started from when it wrote none), waiting up to `recovery_timeout_s` for placement."""
        self.done += 1
        self.fault_at = time.monotonic()
        resume = config.resume_from_checkpoint  # type: ignore[attr-defined]
        try:
            checkpoint_state.latest_complete_tag(config.checkpoint_root)  # type: ignore[attr-defined]
            resume = "latest"
        except FileNotFoundError:
            pass
        logger.warning(
            "fault %d of at most %d restarts: %s; every role stopped, restarting them from %s",
            self.done,
            self.max_restarts,
            fault,
            f"resume_from_checkpoint={resume}" if resume else "the start (no checkpoint yet)",
            extra=MILESTONE,
        )
        return dataclasses.replace(
            config,
            resume_from_checkpoint=resume,  # type: ignore[call-arg]
            placement_timeout_s=self.recovery_timeout_s,
        )

    def wait_for_placement(self, refusal: Exception) -> bool:
        """After the cluster refused the restarted roles (`refusal`: a lost node not back yet), wait a little and
        return True while `recovery_timeout_s` since the fault has not passed; False once it has."""
        waited = time.monotonic() - self.fault_at
        if waited >= self.recovery_timeout_s:
            return False
        limit = self.recovery_timeout_s
        logger.warning("the cluster does not fit the roles yet (%.0f of %.0f s waited): %s", waited, limit, refusal)
        time.sleep(min(PLACEMENT_RETRY_S, self.recovery_timeout_s - waited))
        return True

    def restarted(self) -> dict[str, float]:
        """The metrics every step after a restart carries: the restarts so far and the last one's time (from every
        role stopped to the roles started again; the checkpoint loads after it); logged too."""
        recovery_s = time.monotonic() - self.fault_at
        logger.warning("restart %d: roles started again in %.1f s", self.done, recovery_s, extra=MILESTONE)
        return {"fault/restarts": float(self.done), "fault/recovery_s": recovery_s}
