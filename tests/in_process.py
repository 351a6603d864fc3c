"""Commands run in the test process through the function their shell route calls, saving a Python start each.

`roll-<name> ARGS` calls the function its console script wraps (pyproject's [project.scripts], read from
the installed package's metadata as the script is), and `python <script>.py ARGS` runs the script as
`__main__` (the `examples/start_*.py` twins, the benchmarks). Each runs with its own `sys.argv`, working
directory and environment, with Hydra's global state cleared; its output is captured and its end
(`sys.exit`, an exception, a return, or the end of the process a program of roll asks for) becomes the exit code
the shell would see. Everything it changed
of the process (argv, cwd, environment, sys.path, the root logger, Hydra) is put back afterwards.
Output is captured by swapping sys.stdout and sys.stderr, which every thread of the process shares. A
command must not start Ray here (it would outlive the command): starting it fails the command.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from unittest import mock

import ray
from hydra.core.global_hydra import GlobalHydra

from roll.utils import process_exit

PYTHONS = ("python", "python3", ".venv/bin/python")


@dataclass(frozen=True)
class Outcome:
    """How a command run in this process ended: the exit code a shell would see, and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_in_process(argv: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None) -> Outcome:
    """Run `argv` (`roll-<name> ...` or `python <script>.py ...`) here, in `cwd`, with environment `env` (default:
    this process's), as its shell route would."""
    program, *args = argv
    if program in PYTHONS:
        script, *args = args
        path = (Path(cwd) / script).resolve()

        def main() -> None:
            runpy.run_path(str(path), run_name="__main__")

        # As `python <script>` sets them, but for argv[0]: runpy makes it the script's full path.
        sys_argv, search_path = [str(path), *args], [str(path.parent)]
    else:
        (entry,) = metadata.entry_points(group="console_scripts", name=program)
        main, sys_argv, search_path = entry.load(), [program, *args], []
    # A PYTHONPATH the command sets (`PYTHONPATH=examples/agents roll-agentic ...`) goes on the path after the
    # script's folder, as a new interpreter puts it there.
    python_path = (env if env is not None else os.environ).get("PYTHONPATH", "")
    search_path += [str((Path(cwd) / entry).resolve()) for entry in python_path.split(os.pathsep) if entry]
    stdout, stderr = io.StringIO(), io.StringIO()
    with _restored_process_state(), _ray_refused(), _process_kept():
        os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        sys.argv, sys.path[:0] = sys_argv, search_path
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            returncode = _exit_code(main)
    return Outcome(returncode, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def _ray_refused() -> Iterator[None]:
    """Make starting or joining Ray fail, also when this test process already has a Ray of its own."""
    refusal = RuntimeError("a command run in the test process started Ray")
    with (
        mock.patch.object(ray, "init", side_effect=refusal),
        mock.patch.object(ray, "is_initialized", return_value=False),
    ):
        yield


@contextlib.contextmanager
def _process_kept() -> Iterator[None]:
    """Turn a program's end of its process (roll.utils.process_exit.end_process) into the `sys.exit` it stands for."""
    with mock.patch.object(process_exit, "end_process", side_effect=sys.exit):
        yield


def _exit_code(main: Callable[[], object]) -> int:
    """Call `main`; the exit code of a Python process that did so: 0, `sys.exit`'s, or 1 after a traceback."""
    try:
        main()
    except SystemExit as exc:
        return process_exit.exit_status(exc)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


@contextlib.contextmanager
def _restored_process_state() -> Iterator[None]:
    """Put back what a command may change of this process: argv, cwd, environment, sys.path, root logger, Hydra."""
    argv, cwd, env, search_path = sys.argv, os.getcwd(), dict(os.environ), list(sys.path)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        for handler in set(root.handlers) - set(handlers):
            handler.close()  # Hydra's log file of the run
        root.handlers[:] = handlers
        root.setLevel(level)
        sys.argv, sys.path[:] = argv, search_path
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
