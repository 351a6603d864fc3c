"""The `fault_tolerance` group of a resumable pipeline's config: restarts after a lost worker, and preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.schema import check


@dataclass
class FaultToleranceArguments:
    """How a run reacts to a worker or node it loses, and to SIGTERM/SIGINT (docs/fault_tolerance.md)."""

    # A worker (or its node) that dies stops every role; the run then restarts them and resumes from its last
    # complete checkpoint, in the same process, up to this many times. 0 ends the run with the death's message.
    max_restarts: int = field(
        default=0, metadata=check(ge=0, hint="0 ends the run at the first lost worker; N restarts it N times")
    )
    # How long a restart waits for Ray to grant the roles' reservation again (a lost node coming back, or
    # another taking its place) before the run ends with the death's message.
    recovery_timeout_s: float = field(
        default=300.0, metadata=check(gt=0, hint="seconds a restart waits for the cluster to fit the roles again")
    )
    # After SIGTERM or SIGINT the run finishes its step and checkpoints; past this many seconds after the signal
    # it exits without that checkpoint (the last complete one stays usable). Keep it below the grace period of the
    # scheduler's kill (SLURM's --signal lead time, Kubernetes' terminationGracePeriodSeconds).
    preemption_deadline_s: float = field(
        default=110.0,
        metadata=check(gt=0, hint="seconds between the stop signal and the exit, below the scheduler's grace period"),
    )
