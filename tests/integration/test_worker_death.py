"""A worker killed mid-run ends the run cleanly, and the run resumes from its last complete checkpoint.

Both runs are the RLVR entry point in a process of its own, as a user starts them; the resume names `latest`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.pipeline_runs import logged_metrics
from tests.rlvr_runs import FAST, PARITY_REWARD

pytestmark = pytest.mark.slow
WORKER = "tests.pipeline_workers.FailureTestActorWorker"


def start_run(output_dir: Path, pid_dir: Path, *overrides: str) -> subprocess.Popen:
    """The RLVR entry point in its own process (with its own embedded Ray), as a user starts it."""
    command = [
        sys.executable,
        "examples/start_rlvr_pipeline.py",
        *FAST,
        f"output_dir={output_dir}",
        "eval_steps=100",
        "save_steps=1",
        f"actor_train.worker_cls={WORKER}",
        PARITY_REWARD,
        # actor_train keeps its two ranks (rank 1 is killed); the other roles need one each.
        "actor_infer.device_mapping=0",
        "reference.device_mapping=0",
        f"+actor_train.env_vars.ROLL_PID_DIR={pid_dir}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def errors_of(stderr: str) -> str:
    """The run's stderr without C++ backtrace frames, which would push the error itself out of view."""
    lines = [line for line in stderr.splitlines() if "frame #" not in line]
    return "\n".join(lines)[-4000:]


def wait_for(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_killed_worker_ends_the_run_and_the_run_resumes_from_the_last_complete_checkpoint(tmp_path: Path) -> None:
    output, pids = tmp_path / "out", tmp_path / "pids"
    pids.mkdir()
    run = start_run(output, pids, "max_steps=6", "+actor_train.env_vars.ROLL_TEST_SLOW_SAVE_TAG=step_2")
    try:
        checkpoints = output / "rlvr" / "checkpoints" / "actor_train"
        # step_2's checkpoint is held half written (its staging directory renamed only after 60 s).
        wait_for(lambda: (checkpoints / ".step_2.incomplete").is_dir() or run.poll() is not None, 600, "step 2's save")
        assert run.poll() is None, errors_of(run.communicate()[1])
        os.kill(int((pids / "actor_train-1.pid").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = run.communicate(timeout=120)
        elapsed = time.monotonic() - killed
    finally:
        run.kill()
    assert run.returncode == 1, errors_of(stderr)
    assert elapsed < 60, elapsed
    last_lines = stderr.strip().splitlines()[-3:]
    assert any("run failed: actor_train rank 1 died (node " in line for line in last_lines), last_lines
    # The half-written checkpoint is not taken for a good one.
    assert (checkpoints / "latest").read_text().strip() == "step_1"
    assert not (checkpoints / "step_2").exists()
    logged = logged_metrics(output / "rlvr")
    assert [row["step"] for row in logged][:2] == [0, 1]

    # The resume puts actor_infer on a device of its own: the weights then reach it over the broadcast group, which
    # the resumed run forms anew (the inference layout is not part of the checkpoint).
    on_its_own = ("devices_per_node=3", "actor_infer.device_mapping=2")
    resumed = start_run(output, pids, "max_steps=3", "resume_from_checkpoint=latest", *on_its_own)
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, errors_of(stderr)
    rows = logged_metrics(output / "rlvr")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert rows[:2] == logged[:2]  # the rows up to the checkpoint as they were; the steps after it logged anew
    assert rows[3]["actor/grad_norm"] > 0  # past the killed run's last step, training goes on
    assert rows[3]["sync/broadcast_bytes"] > 0 and rows[3]["sync/colocated_bytes"] == 0
