"""A worker killed mid-run ends the run cleanly, and the run resumes from its last complete checkpoint; with
`fault_tolerance.max_restarts` the run restarts by itself, and SIGTERM stops it with a checkpoint.

One chain of runs feeds every test. The runs with faults are the RLVR entry point in a process of its own, as a
user starts them: one under `max_restarts=1` whose training worker is killed twice while step 2's checkpoint is
held half written (the first death restarts the roles, the second ends the run), then its resume, which names
`latest`, in a new process with actor_infer on a device of its own, stopped by SIGTERM. The last resume runs to the
end in the test process and is compared with one uninterrupted run there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roll.pipeline.base import checkpoint_state
from roll.pipeline.base.preemption import PREEMPTED_EXIT_CODE
from roll.utils.staged_checkpoint import MARKER
from tests.conftest import REPO_ROOT
from tests.pipeline_runs import logged_metrics
from tests.rlvr_runs import FAST, PARITY_REWARD, run_rlvr
from tests.unit.test_hydra_configs import load_config

pytestmark = pytest.mark.slow
WORKER = "tests.pipeline_workers.FailureTestActorWorker"

# Six steps, the whole held-out check only before and after, a checkpoint every two steps (the killed run: every
# step, so that step 1's is complete when step 2's is held half written).
SIX_STEPS = ("max_steps=6", "save_steps=2", "eval_steps=100")
SAME = ("rollout/score_mean", "rollout/response_length_mean", "actor/loss", "actor/kl", "actor/grad_norm")
# actor_infer on a device of its own: the weights reach it over the broadcast group, which a resumed run forms anew
# (the inference layout is not part of the checkpoint).
ON_ITS_OWN = ("devices_per_node=3", "actor_infer.device_mapping=2")


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


@dataclass
class Run:
    """A run of the entry point in its own process."""

    process: subprocess.Popen
    stderr_file: Path

    @property
    def stderr(self) -> str:
        """What the run wrote to stderr so far."""
        return self.stderr_file.read_text()

    def finish(self, timeout_s: float) -> str:
        """Wait for the run to end (killing it past `timeout_s`); its stderr."""
        try:
            self.process.wait(timeout=timeout_s)
        finally:
            self.process.kill()
            self.process.wait()
        return self.stderr


@dataclass
class Ended:
    """What a run of the entry point left: its run directory, the metrics rows, its stderr and exit code."""

    run_dir: Path
    rows: list[dict]
    stderr: str
    returncode: int


def start_run(output_dir: Path, pid_dir: Path, name: str, *overrides: str) -> Run:
    """The RLVR entry point in its own process (with its own embedded Ray), as a user starts it, SIX_STEPS then
    `overrides`. Its output goes to files `name`.out/.err beside `output_dir`: a pipe nobody reads while the test
    waits could fill up and stall the run."""
    command = [
        sys.executable,
        "examples/start_rlvr_pipeline.py",
        *killable(pid_dir),
        f"output_dir={output_dir}",
        *SIX_STEPS,
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    stdout_file, stderr_file = output_dir.parent / f"{name}.out", output_dir.parent / f"{name}.err"
    with stdout_file.open("w") as stdout, stderr_file.open("w") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=stdout, stderr=stderr)
    return Run(process, stderr_file)


def errors_of(stderr: str) -> str:
    """The run's stderr without C++ backtrace frames, which would push the error itself out of view."""
    lines = [line for line in stderr.splitlines() if "frame #" not in line]
    return "\n".join(lines)[-4000:]


def wait_for(condition: Callable[[], object], run: Run, timeout_s: float, what: str) -> None:
    """Wait until `condition()` holds; fail (with the run's errors) if `run` ends first or past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert run.process.poll() is None, errors_of(run.stderr)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def last_row(run_dir: Path) -> dict:
    """The last metrics row the run logged so far ({} before the first; a line may be half written)."""
    try:
        return logged_metrics(run_dir)[-1]
    except (FileNotFoundError, IndexError, json.JSONDecodeError):
        return {}


def held_save(checkpoints: Path, tag: str) -> float | None:
    """When the save of `tag` now held half written began its rename (its marker's time), or None: actor_train's
    rank 0 waits in the rename that completes it (ROLL_TEST_SLOW_SAVE_TAG), every rank's part written."""
    try:
        return json.loads((checkpoints / f".{tag}.incomplete" / MARKER).read_text())["time"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def kill_rank_1(pids: Path) -> int:
    """SIGKILL actor_train's rank 1; its pid."""
    pid = int((pids / "actor_train-1.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    return pid


def resumed_step(row: dict) -> bool:
    """Whether `row` is a step the resume of the killed run logged (past step 1, not the restarted run's)."""
    return row.get("step", 0) >= 2 and "fault/restarts" not in row


@pytest.fixture(scope="module")
def uninterrupted(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """SIX_STEPS without a fault, in the test process: its run directory and its metrics rows."""
    output = tmp_path_factory.mktemp("uninterrupted")
    pids = output / "pids"
    pids.mkdir()
    config = load_config("rlvr_arithmetic", [*killable(pids), f"output_dir={output}", *SIX_STEPS])
    return output / "rlvr", run_rlvr(config)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Ended, float]:
    """SIX_STEPS as a user runs it with `fault_tolerance.max_restarts=1` and a checkpoint every step, step 2's held
    half written for 60 s: actor_train rank 1 killed while it is held, then again while the restarted run's save of
    step 2 is held. What the run left, and the seconds from the second kill to its end."""
    base = tmp_path_factory.mktemp("killed")
    output, pids = base / "out", base / "pids"
    pids.mkdir()
    run = start_run(
        output, pids, "killed", "save_steps=1", "fault_tolerance.max_restarts=1",
        "+actor_train.env_vars.ROLL_TEST_SLOW_SAVE_TAG=step_2",
    )  # fmt: skip
    run_dir = output / "rlvr"
    checkpoints = run_dir / "checkpoints" / "actor_train"
    try:
        wait_for(lambda: held_save(checkpoints, "step_2"), run, 600, "step 2's save")
        first_hold = held_save(checkpoints, "step_2")
        first_pid = kill_rank_1(pids)
        # The restarted run logs step 2 again, then holds its save of step 2 anew (a marker of a later time).
        wait_for(lambda: "fault/restarts" in last_row(run_dir), run, 600, "the restarted run's step 2")
        wait_for(lambda: held_save(checkpoints, "step_2") not in (None, first_hold), run, 600, "step 2's second save")
        assert kill_rank_1(pids) != first_pid  # the restarted run's rank 1
        killed_at = time.monotonic()
        stderr = run.finish(120)
        elapsed = time.monotonic() - killed_at
    finally:
        run.process.kill()
    return Ended(run_dir, logged_metrics(run_dir), stderr, run.process.returncode), elapsed


@pytest.fixture(scope="module")
def preempted(killed: tuple[Ended, float]) -> Ended:
    """The killed run resumed (`latest`) in a new process with actor_infer on a device of its own, SIGTERM to the
    driver once it logged a step."""
    run_dir = killed[0].run_dir
    output, pids = run_dir.parent, run_dir.parent.parent / "pids"
    run = start_run(output, pids, "preempted", "resume_from_checkpoint=latest", *ON_ITS_OWN)
    try:
        # The resumed run truncates the rows to its checkpoint's step, dropping the restarted run's step 2.
        wait_for(lambda: resumed_step(last_row(run_dir)), run, 600, "the resumed run's first step")
        run.process.send_signal(signal.SIGTERM)
        stderr = run.finish(300)
    finally:
        run.process.kill()
    return Ended(run_dir, logged_metrics(run_dir), stderr, run.process.returncode)


def test_a_killed_worker_under_max_restarts_restarts_the_roles_from_the_last_complete_checkpoint(
    uninterrupted: tuple[Path, list[dict]], killed: tuple[Ended, float]
) -> None:
    _, expected = uninterrupted
    run, _ = killed
    assert "fault 1 of at most 1 restarts: actor_train rank 1 died (node " in run.stderr, errors_of(run.stderr)
    # The restart took step 1's checkpoint, not step 2's, held half written when the worker died: it repeats step 2.
    assert [row["step"] for row in run.rows] == [0, 1, 2]
    after = [row for row in run.rows if row["step"] > 1]
    assert after and all(row["fault/restarts"] == 1 and row["fault/recovery_s"] > 0 for row in after)
    for row in after:
        for key in SAME:
            assert row[key] == pytest.approx(expected[row["step"]][key], rel=1e-6, abs=1e-9), (row["step"], key)


def test_a_killed_worker_with_no_restart_left_ends_the_run_and_its_half_written_checkpoint_is_not_taken(
    killed: tuple[Ended, float],
) -> None:
    run, elapsed = killed
    assert run.returncode == 1, errors_of(run.stderr)
    assert elapsed < 60, elapsed  # within the 60 s step 2's save is held: the death ended the run, not the save
    last_lines = run.stderr.strip().splitlines()[-3:]
    assert any("run failed: actor_train rank 1 died (node " in line for line in last_lines), last_lines
    checkpoints = run.run_dir / "checkpoints" / "actor_train"
    assert (checkpoints / "latest").read_text().strip() == "step_1"
    assert not (checkpoints / "step_2").exists()
    assert checkpoint_state.latest_complete_tag(run.run_dir / "checkpoints") == "step_1"


def test_sigterm_checkpoints_the_step_of_a_run_resumed_in_a_new_process_that_syncs_over_broadcast(
    killed: tuple[Ended, float], preempted: Ended
) -> None:
    run = preempted
    assert run.returncode == PREEMPTED_EXIT_CODE, errors_of(run.stderr)
    assert "run preempted: stopped on a signal after step " in run.stderr.strip().splitlines()[-1]
    stopped = run.rows[-1]["step"]
    assert 2 <= stopped < 6
    assert checkpoint_state.latest_complete_tag(run.run_dir / "checkpoints") == f"step_{stopped}"
    assert [row["step"] for row in run.rows] == list(range(stopped + 1))
    assert run.rows[:2] == killed[0].rows[:2]  # the rows up to the checkpoint as they were; the steps after it anew
    for row in run.rows[2:]:
        assert "fault/restarts" not in row
        assert row["actor/grad_norm"] > 0  # past the killed run's last complete step, training goes on
        assert row["sync/broadcast_bytes"] > 0 and row["sync/colocated_bytes"] == 0


def test_the_run_resumed_after_sigterm_ends_with_the_uninterrupted_weights(
    ray_session: None, uninterrupted: tuple[Path, list[dict]], preempted: Ended
) -> None:
    expected_dir, expected = uninterrupted
    run_dir = preempted.run_dir
    output = run_dir.parent
    resumed = load_config(
        "rlvr_arithmetic",
        [*killable(output.parent / "pids"), f"output_dir={output}", *SIX_STEPS, "resume_from_checkpoint=latest"],
    )
    rows = run_rlvr(resumed)
    assert [row["step"] for row in rows] == list(range(7))
    # Every step but the held-out check before training: the killed run's step 1, the steps of the resume on the
    # broadcast layout, and this run's.
    for row in rows[1:]:
        for key in SAME:
            assert row[key] == pytest.approx(expected[row["step"]][key], rel=1e-6, abs=1e-9), (row["step"], key)
    weights = load_file(run_dir / "model" / "model.safetensors")
    reference = load_file(expected_dir / "model" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
