"""The driver's side of fault tolerance without Ray: stop signals, their deadline, and what a restart resumes from."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from roll.distributed.executor.cluster import WorkerDiedError
from roll.distributed.scheduler.placement import PlacementError
from roll.pipeline.base.checkpoint_state import save_driver_state
from roll.pipeline.base.preemption import PREEMPTED_EXIT_CODE, StopSignals
from roll.pipeline.base.recovery import Restarts
from tests.unit.test_config_validation import rlvr


def test_the_first_signal_asks_for_a_stop_and_a_second_ctrl_c_interrupts() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signals = StopSignals(deadline_s=60)
    signals.install()
    try:
        assert not signals.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs in the main thread between bytecodes
        assert signals.requested and signals.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM changes nothing
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        signals.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_past_the_deadline_the_process_exits_with_the_preempted_status() -> None:
    pid = os.fork()
    if pid == 0:
        signals = StopSignals(deadline_s=0.2)
        signals.install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # a step that does not end
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == PREEMPTED_EXIT_CODE


def test_a_restart_resumes_from_the_last_complete_checkpoint_and_waits_for_placement_its_own_time(
    tmp_path: Path,
) -> None:
    config = rlvr(f"output_dir={tmp_path}", "fault_tolerance.max_restarts=2", "fault_tolerance.recovery_timeout_s=33")
    restarts = Restarts(config)
    death = WorkerDiedError("actor_train rank 1 died (node 10.0.0.2, pid 7)")
    first = restarts.next_config(config, death)
    assert (first.resume_from_checkpoint, first.placement_timeout_s) == ("", 33)  # no checkpoint yet: from the start
    save_driver_state(config.checkpoint_root, "step_4", {"step": 4})
    second = restarts.next_config(first, death)
    assert second.resume_from_checkpoint == "latest" and restarts.done == 2 and not restarts.left
    metrics = restarts.restarted()
    assert metrics["fault/restarts"] == 2 and metrics["fault/recovery_s"] >= 0
    assert not Restarts(rlvr(f"output_dir={tmp_path}")).left  # max_restarts 0: today's behaviour


def test_a_cluster_that_lost_a_node_is_tried_again_until_the_recovery_timeout(tmp_path: Path) -> None:
    config = rlvr(f"output_dir={tmp_path}", "fault_tolerance.max_restarts=1", "fault_tolerance.recovery_timeout_s=0.3")
    restarts = Restarts(config)
    restarts.next_config(config, WorkerDiedError("actor_infer rank 0 died (node 10.0.0.3, pid 9)"))
    refusal = PlacementError("the cluster has 1 alive node")
    started = time.monotonic()
    assert restarts.wait_for_placement(refusal)  # within the timeout: wait, then try again
    assert not restarts.wait_for_placement(refusal)  # past it: the run ends
    assert 0.25 < time.monotonic() - started < 2
