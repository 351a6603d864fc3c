"""The code sandbox under hostile programs: each ends within its limits and leaves the run unharmed."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from roll.rewards.code_sandbox import _FIRST_SANDBOX_UID, Limits, _others_may_run, run_python

LIMITS = Limits(time_s=1.5, memory_mb=256, output_bytes=64 * 1024, processes=8)
# For programs that end without the clock (by themselves or on another limit): under the suite's load, starting an
# interpreter alone can take 1.5 s.
ROOMY = dataclasses.replace(LIMITS, time_s=30)
SYSTEM_PYTHON = "/usr/bin/python3"
# Both ways a run is confined: under a user id of its own (root, an interpreter others may run),
# and under the caller's id with the audit hook refusing fork and outside writes.
MODES = [
    pytest.param({"own_user": False}, id="caller-id"),
    pytest.param(
        {"python": SYSTEM_PYTHON},
        id="own-id",
        marks=pytest.mark.skipif(
            os.geteuid() != 0 or not Path(SYSTEM_PYTHON).exists() or not _others_may_run(SYSTEM_PYTHON),
            reason="a user id of its own needs root and an interpreter every user may run",
        ),
    ),
]


def sandbox_processes(within_s: float = 3.0) -> list[psutil.Process]:
    """Processes still running under a sandbox user id `within_s` seconds from now (zombies are dead already).

    A SIGKILLed process stays "running" until the kernel schedules it to die, which takes longer on two busy cores
    (the suite runs two test files at a time, and the other may run sandboxes of its own): poll until none is left.
    """
    deadline = time.monotonic() + within_s
    while True:
        found = []
        for process in psutil.process_iter(["uids", "status"]):
            uids, status = process.info["uids"], process.info["status"]
            if uids and uids.real >= _FIRST_SANDBOX_UID and status != psutil.STATUS_ZOMBIE:
                found.append(process)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.parametrize("mode", MODES)
def test_a_well_behaved_program_reads_stdin(mode: dict) -> None:
    result = run_python("print(int(input()) * 2)", "21\n", ROOMY, **mode)
    assert (result.returncode, result.stdout, result.timed_out) == (0, "42\n", False)


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_contained_and_killed(mode: dict) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    started = time.monotonic()
    result = run_python(bomb, "", LIMITS, **mode)
    assert time.monotonic() - started < LIMITS.time_s + 3
    assert result.timed_out
    assert not sandbox_processes()
    pid = os.fork()  # this process still creates processes
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


@pytest.mark.parametrize("mode", MODES)
def test_children_are_killed_even_outside_the_session(mode: dict) -> None:
    orphan = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(os.getpid())\n"
    run_python(orphan, "", LIMITS, **mode)
    assert not sandbox_processes()
    hang = "import time\ntime.sleep(60)\n"
    started = time.monotonic()
    result = run_python(hang, "", LIMITS, **mode)
    assert result.timed_out and result.returncode < 0 and time.monotonic() - started < LIMITS.time_s + 2


@pytest.mark.parametrize("mode", MODES)
def test_endless_output_is_cut_at_the_limit(mode: dict) -> None:
    result = run_python("while True:\n    print('x' * 1000)\n", "", ROOMY, **mode)
    assert not result.timed_out  # ended by the output limit, not by the clock
    assert len(result.stdout) == ROOMY.output_bytes and result.returncode != 0


@pytest.mark.parametrize("mode", MODES)
def test_writes_outside_its_directory_fail_and_inside_work(mode: dict, tmp_path: Path) -> None:
    target = tmp_path / "pwned.txt"
    code = (
        f"open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\n"
        f"import os\ntry:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError as e:\n    print('refused')\n"
        f"try:\n    os.remove({sys.executable!r})\nexcept OSError:\n    print('refused')\n"
    )
    result = run_python(code, "", ROOMY, **mode)
    assert result.stdout.split() == ["ok", "refused", "refused"], result.stderr
    assert not target.exists() and Path(sys.executable).exists()


@pytest.mark.parametrize("mode", MODES)
def test_no_network_and_no_memory_beyond_the_limit(mode: dict) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", "", ROOMY, **mode
        )
        assert result.returncode != 0 and not result.timed_out
        server.settimeout(0.1)
        with pytest.raises(TimeoutError):
            server.accept()
    result = run_python("x = bytearray(1 << 30)\n", "", ROOMY, **mode)
    assert result.returncode != 0 and "MemoryError" in result.stderr
