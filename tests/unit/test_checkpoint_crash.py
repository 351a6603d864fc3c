"""A checkpoint writer killed (SIGKILL) at any file operation of a save leaves the previous checkpoint usable, and
`keep_last_n` never removes the only complete checkpoint.

The writer is a child process that saves as a pipeline does: a role's staged checkpoint
(roll/utils/staged_checkpoint.py, a one-rank gloo group), then the driver state, `latest` and the removal of old
checkpoints (roll/pipeline/base/checkpoint_state.py). It kills itself just before its k-th file operation, for
every k of a save; the test process then resumes from `latest` as a restarted run would, and saves again.
The children come from a fork server that preloads this module: forking the test process itself, which may hold the
session's Ray and its gRPC threads, once left it hung in a later Ray call.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from roll.pipeline.base import checkpoint_state
from roll.pipeline.base.checkpoint_state import ROLES, latest_complete_tag, load_driver_state, remove_old_checkpoints
from roll.utils.staged_checkpoint import MARKER, check_checkpoint_backend, resolve_checkpoint, staged_checkpoint

ROLE = "actor_train"


def save(root: Path, step: int, keep_last_n: int) -> None:
    """A pipeline's save of `step`: the role's checkpoint (its weights filled with `step`), then the driver's."""
    tag = f"step_{step}"
    with staged_checkpoint(str(root / ROLE), tag, {}) as staging:
        torch.save({"w": torch.full((2,), float(step))}, staging / "model.pt")
    checkpoint_state.save_driver_state(root, tag, {"step": step, ROLES: [ROLE]}, keep_last_n)


def killed_before(operation: int | None, counted: list[int]) -> Callable[[Callable], Callable]:
    """A wrapper of a file operation that counts it in `counted` and SIGKILLs this process before number
    `operation`."""

    def wrap(function: Callable) -> Callable:
        def counting(*args: Any, **kwargs: Any) -> Any:
            counted[0] += 1
            if counted[0] == operation:
                os.kill(os.getpid(), signal.SIGKILL)
            return function(*args, **kwargs)

        return counting

    return wrap


def save_in_child(root: Path, step: int, keep_last_n: int, kill_before: int | None = None) -> tuple[int, int]:
    """Run `save` in a child process, killed before its file operation `kill_before` (None: not killed); the
    child's exit code (negative: the signal that ended it) and the file operations it made (when it finished)."""
    count_file = root.parent / f"{root.name}.operations"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    child = context.Process(target=_save_counting, args=(root, step, keep_last_n, kill_before, count_file))
    child.start()
    child.join()
    return child.exitcode, int(count_file.read_text()) if kill_before is None else 0


def _save_counting(root: Path, step: int, keep_last_n: int, kill_before: int | None, count_file: Path) -> None:
    """The child's work: `save` with its file operations counted into `count_file`, killed before `kill_before`."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    counted = [0]
    wrap = killed_before(kill_before, counted)
    operations = [(os, "replace"), (os, "unlink"), (os, "rmdir"), (os, "mkdir"), (Path, "write_text")]
    with mock.patch("torch.save", wrap(torch.save)):
        patches = [mock.patch.object(owner, name, wrap(getattr(owner, name))) for owner, name in operations]
        for patch in patches:
            patch.start()
        save(root, step, keep_last_n)
        for patch in patches:
            patch.stop()
    count_file.write_text(str(counted[0]))


def assert_usable(root: Path, steps: set[int]) -> int:
    """`latest` resolves to a complete checkpoint of one of `steps` whose role checkpoint holds its weights."""
    state = load_driver_state(root, None)
    assert state["step"] in steps
    role_checkpoint = resolve_checkpoint(str(root / ROLE), f"step_{state['step']}")
    weights = torch.load(role_checkpoint / "model.pt")["w"]
    assert torch.equal(weights, torch.full((2,), float(state["step"])))
    return state["step"]


def test_a_writer_killed_at_any_operation_leaves_a_usable_checkpoint_and_the_next_save_succeeds(
    tmp_path: Path,
) -> None:
    base = tmp_path / "base"
    for step in (1, 2):
        status, _ = save_in_child(base, step, keep_last_n=2)
        assert status == 0
    # Step 3 with keep_last_n=2 writes the role's checkpoint, the driver state and latest, then removes step 1.
    rehearsal = tmp_path / "rehearsal"
    shutil.copytree(base, rehearsal)
    _, operations = save_in_child(rehearsal, 3, keep_last_n=2)
    assert operations >= 12, operations
    assert assert_usable(rehearsal, {3}) == 3 and not (rehearsal / "step_1").exists()

    outcomes = set()
    for kill_before in range(1, operations + 1):
        root = tmp_path / f"killed_{kill_before}"
        shutil.copytree(base, root)
        status, _ = save_in_child(root, 3, keep_last_n=2, kill_before=kill_before)
        assert status == -signal.SIGKILL, kill_before
        outcomes.add(assert_usable(root, {2, 3}))
        status, _ = save_in_child(root, 3, keep_last_n=2)  # the restarted run saves step 3 again
        assert status == 0, kill_before
        assert assert_usable(root, {3}) == 3
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_2", "step_3"]
    assert outcomes == {2, 3}  # killed before the driver state is in place: step 2; after: step 3


def test_latest_naming_an_incomplete_checkpoint_picks_the_newest_complete_one(tmp_path: Path) -> None:
    status, _ = save_in_child(tmp_path, 1, keep_last_n=0)
    assert status == 0
    status, _ = save_in_child(tmp_path, 2, keep_last_n=0)
    assert status == 0
    shutil.rmtree(tmp_path / ROLE / "step_2")  # e.g. a re-save of step 2 killed after the old one was retired
    assert latest_complete_tag(tmp_path) == "step_1"
    assert load_driver_state(tmp_path, None)["step"] == 1
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_driver_state(tmp_path, "step_2")


def test_keep_last_n_never_removes_the_only_complete_checkpoint(tmp_path: Path) -> None:
    status, _ = save_in_child(tmp_path, 1, keep_last_n=1)
    assert status == 0
    # Steps 2 and 3 written by the driver but not by the role (a crash, or a save cut short): incomplete.
    for step in (2, 3):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "driver_state.json").write_text(f'{{"step": {step}, "roles": ["{ROLE}"]}}')
    (tmp_path / "latest").write_text("step_3")
    assert remove_old_checkpoints(tmp_path, 1) == []
    assert assert_usable(tmp_path, {1}) == 1
    status, _ = save_in_child(tmp_path, 4, keep_last_n=1)
    assert status == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_4"]
    assert sorted(p.name for p in (tmp_path / ROLE).iterdir() if p.name.startswith("step_")) == ["step_4"]


def test_a_checkpoint_of_another_training_backend_is_refused_with_the_way_to_switch(tmp_path: Path) -> None:
    """A backend resumes only its own checkpoints (one without a record is DeepSpeed's); the error says how to move a
    run to the other backend."""
    for backend, marker in (("fsdp2_train", {"backend": "fsdp2_train"}), ("deepspeed_train", {})):
        path = tmp_path / backend
        path.mkdir()
        (path / MARKER).write_text(json.dumps({"dp_size": 2, **marker}))
        check_checkpoint_backend(path, backend)
        other = "deepspeed_train" if backend == "fsdp2_train" else "fsdp2_train"
        with pytest.raises(ValueError, match=rf"written by {backend}, and {other} resumes only its own.*pretrain="):
            check_checkpoint_backend(path, other)
