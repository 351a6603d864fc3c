"""roll.utils.process_exit: a program's end keeps what a normal exit does that can be seen, and skips the teardown.

Each case is a new Python process (its end is what is tested). A module global whose finalizer leaves a mark
shows whether the interpreter tore the process's objects down: a normal exit does (the control case).
"""

from __future__ import annotations

import atexit
import io
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from roll.utils import process_exit

PROGRAM = """
import atexit, concurrent.futures, os, sys, threading, time
from pathlib import Path
from roll.utils.process_exit import run_as_program, skip_teardown_at_exit

marks = Path(sys.argv[1])

class TornDown:
    def __del__(self, _open=os.open, _close=os.close, _path=str(marks / "torn-down")):
        _close(_open(_path, os.O_CREAT | os.O_WRONLY))

KEPT = TornDown()
atexit.register(lambda: (marks / "atexit-first-registered").write_text(str(time.monotonic_ns())))

def late_thread():
    time.sleep(0.3)
    (marks / "thread").write_text("joined")

threading.Thread(target=late_thread).start()
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: (time.sleep(0.3), (marks / "pool").write_text("done")))
print("unflushed", end="")
{body}
"""


def run(body: str, marks: Path) -> subprocess.CompletedProcess[str]:
    program = PROGRAM.format(body=textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-c", program, str(marks)], capture_output=True, text=True, timeout=120, check=False
    )


def seen(marks: Path) -> set[str]:
    return {path.name for path in marks.iterdir()}


VISIBLE = {"atexit-first-registered", "thread", "pool"}


def test_a_normal_exit_tears_the_objects_down(tmp_path: Path) -> None:
    """The control: without roll's end, the finalizer's mark appears (else the other tests could not fail)."""
    ended = run("sys.exit(0)", tmp_path)
    assert ended.returncode == 0, ended.stderr
    assert seen(tmp_path) == VISIBLE | {"torn-down"}


@pytest.mark.parametrize(
    ("body", "status", "stderr"),
    [
        ("run_as_program(lambda: None)", 0, ""),
        ("run_as_program(lambda: sys.exit(3))", 3, ""),
        ("run_as_program(lambda: sys.exit('config error: x'))", 1, "config error: x\n"),
    ],
)
def test_a_program_ends_with_its_status_its_threads_handlers_and_output_but_no_teardown(
    tmp_path: Path, body: str, status: int, stderr: str
) -> None:
    ended = run(body, tmp_path)
    assert (ended.returncode, ended.stderr) == (status, stderr)
    assert ended.stdout == "unflushed"
    assert seen(tmp_path) == VISIBLE


def test_an_exception_ends_the_normal_way_with_its_traceback(tmp_path: Path) -> None:
    ended = run("run_as_program(lambda: 1 / 0)", tmp_path)
    assert ended.returncode == 1
    assert "ZeroDivisionError" in ended.stderr
    assert seen(tmp_path) == VISIBLE | {"torn-down"}


def test_skipping_the_teardown_at_exit_runs_every_handler_in_the_normal_order(tmp_path: Path) -> None:
    """Handlers registered before and after the call run, the later one first, as at a normal exit."""
    ended = run(
        """
        skip_teardown_at_exit()
        skip_teardown_at_exit()  # twice: still one end
        atexit.register(lambda: (marks / "atexit-last-registered").write_text(str(time.monotonic_ns())))
        """,
        tmp_path,
    )
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout == "unflushed"
    assert seen(tmp_path) == VISIBLE | {"atexit-last-registered"}
    last, first = (int((tmp_path / name).read_text()) for name in ("atexit-last-registered", "atexit-first-registered"))
    assert last < first


class Ended(Exception):
    """Stands for `os._exit` in this process, whose end the suite needs."""


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The steps of an end, recorded instead of taken: threads joined, handlers run, the exit. The test patches the
    streams itself (`record_flushes`): pytest puts its capture back on sys.stdout when a test's call starts."""
    taken: list[object] = []

    def exit_now(code: int) -> None:
        taken.append(code)
        raise Ended

    monkeypatch.setattr(threading, "_shutdown", lambda: taken.append("threads"))
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: taken.append("atexit"))
    monkeypatch.setattr(os, "_exit", exit_now)
    return taken


def record_flushes(monkeypatch: pytest.MonkeyPatch, taken: list[object]) -> None:
    """sys.stdout records its flush; sys.stderr is closed, which an end leaves alone as a normal exit does."""

    class Stream:
        def flush(self) -> None:
            taken.append("flush")

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdout", Stream())
    monkeypatch.setattr(sys, "stderr", closed)


def test_an_end_takes_the_steps_of_a_normal_exit_in_its_order(
    steps: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process, with each step recorded: coverage.py cannot see the steps after its own exit handler in
    the processes above."""
    record_flushes(monkeypatch, steps)
    with pytest.raises(Ended):
        process_exit.end_process(5)
    assert steps == ["threads", "atexit", "flush", 5]


def test_the_exit_handler_runs_the_other_handlers_then_ends_with_status_0(
    steps: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    record_flushes(monkeypatch, steps)
    with pytest.raises(Ended):
        process_exit._end_at_exit()
    assert steps == ["atexit", "flush", 0]
