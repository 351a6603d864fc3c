"""A worker killed mid-run ends the run cleanly, and the run resumes from its last complete checkpoint; with
`fault_tolerance.max_restarts` the run restarts by itself, and SIGTERM stops it with a checkpoint.

The runs with faults are the RLVR entry point in a process of its own, as a user starts them; the resumes name
`latest`. The fault-tolerance tests compare with one uninterrupted run in the test process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roll.pipeline.base import checkpoint_state
from roll.pipeline.base.preemption import PREEMPTED_EXIT_CODE
from tests.conftest import REPO_ROOT
from tests.pipeline_runs import logged_metrics
from tests.rlvr_runs import FAST, PARITY_REWARD, run_rlvr
from tests.unit.test_hydra_configs import load_config

pytestmark = pytest.mark.slow
WORKER = "tests.pipeline_workers.FailureTestActorWorker"


def killable(pid_dir: Path) -> tuple[str, ...]:
    """FAST with a reward that varies, whose actor_train ranks write their pids to `pid_dir`."""
    return (
        *FAST,
        f"actor_train.worker_cls={WORKER}",
        PARITY_REWARD,
        # actor_train keeps its two ranks (rank 1 is killed); the other roles need one each.
        "actor_infer.device_mapping=0",
        "reference.device_mapping=0",
        f"+actor_train.env_vars.ROLL_PID_DIR={pid_dir}",
    )


def start_run(output_dir: Path, pid_dir: Path, *overrides: str) -> subprocess.Popen:
    """The RLVR entry point in its own process (with its own embedded Ray), as a user starts it."""
    command = [
        sys.executable,
        "examples/start_rlvr_pipeline.py",
        *killable(pid_dir),
        f"output_dir={output_dir}",
        "eval_steps=100",
        "save_steps=1",
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


# The fault-tolerance runs: six steps, a checkpoint every two, the whole held-out check only before and after.
SIX_STEPS = ("max_steps=6", "save_steps=2", "eval_steps=100")
SAME = ("rollout/score_mean", "rollout/response_length_mean", "actor/loss", "actor/kl", "actor/grad_norm")


@pytest.fixture(scope="module")
def uninterrupted(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """SIX_STEPS without a fault, in the test process: its run directory and its metrics rows."""
    output = tmp_path_factory.mktemp("uninterrupted")
    pids = output / "pids"
    pids.mkdir()
    config = load_config("rlvr_arithmetic", [*killable(pids), f"output_dir={output}", *SIX_STEPS])
    return output / "rlvr", run_rlvr(config)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str, int]:
    """SIX_STEPS as a user runs it with `fault_tolerance.max_restarts=1`: actor_train rank 1 killed once step 2's
    checkpoint is complete, then, once the restarted run logged step 3, SIGTERM to the driver. Its run directory,
    the metrics rows it left, its stderr and its exit code."""
    output, pids = tmp_path_factory.mktemp("interrupted"), tmp_path_factory.mktemp("pids")
    run = start_run(output, pids, *SIX_STEPS, "fault_tolerance.max_restarts=1")
    run_dir = output / "rlvr"
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file() or run.poll() is not None, 600, "step 2")
        assert run.poll() is None, errors_of(run.communicate()[1])
        os.kill(int((pids / "actor_train-1.pid").read_text()), signal.SIGKILL)
        # The restarted run truncates the rows to step 2 and logs step 3 again.
        wait_for(lambda: restarted(run_dir) or run.poll() is not None, 600, "the restarted run's step 3")
        assert run.poll() is None, errors_of(run.communicate()[1])
        run.send_signal(signal.SIGTERM)
        _, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
    return run_dir, logged_metrics(run_dir), stderr, run.returncode


def restarted(run_dir: Path) -> bool:
    """Whether the last row the run logged so far is one of a restarted run (a line may be half written)."""
    try:
        return "fault/restarts" in logged_metrics(run_dir)[-1]
    except (FileNotFoundError, IndexError, json.JSONDecodeError):
        return False


def test_a_killed_worker_under_max_restarts_restarts_the_roles_and_repeats_the_uninterrupted_steps(
    uninterrupted: tuple[Path, list[dict]], interrupted: tuple[Path, list[dict], str, int]
) -> None:
    _, expected = uninterrupted
    _, rows, stderr, _ = interrupted
    assert "fault 1 of at most 1 restarts: actor_train rank 1 died (node " in stderr, errors_of(stderr)
    assert [row["step"] for row in rows][:3] == [0, 1, 2]
    after = [row for row in rows if row["step"] > 2]
    assert after and all(row["fault/restarts"] == 1 and row["fault/recovery_s"] > 0 for row in after)
    for row in after:
        for key in SAME:
            assert row[key] == pytest.approx(expected[row["step"]][key], rel=1e-6, abs=1e-9), (row["step"], key)


def test_sigterm_checkpoints_the_step_and_the_resumed_run_ends_with_the_uninterrupted_weights(
    ray_session: None, uninterrupted: tuple[Path, list[dict]], interrupted: tuple[Path, list[dict], str, int]
) -> None:
    expected_dir, expected = uninterrupted
    run_dir, rows, stderr, returncode = interrupted
    assert returncode == PREEMPTED_EXIT_CODE, errors_of(stderr)
    assert "run preempted: stopped on a signal after step " in stderr.strip().splitlines()[-1]
    stopped = rows[-1]["step"]
    assert 3 <= stopped < 6
    assert checkpoint_state.latest_complete_tag(run_dir / "checkpoints") == f"step_{stopped}"

    output = run_dir.parent
    pids = output / "pids"
    pids.mkdir(exist_ok=True)
    resumed = load_config(
        "rlvr_arithmetic", [*killable(pids), f"output_dir={output}", *SIX_STEPS, "resume_from_checkpoint=latest"]
    )
    rows = run_rlvr(resumed)
    assert [row["step"] for row in rows] == list(range(7))
    for row in rows[1:]:
        for key in SAME:
            assert row[key] == pytest.approx(expected[row["step"]][key], rel=1e-6, abs=1e-9), (row["step"], key)
    weights = load_file(run_dir / "model" / "model.safetensors")
    reference = load_file(expected_dir / "model" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
