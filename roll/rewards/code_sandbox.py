"""Run an untrusted Python program in a child process under OS limits (the code reward's test runner).

Each run gets a fresh temporary directory (its working directory, removed afterwards), a session of
its own, rlimits on memory, CPU time, file size (stdout and stderr are files, so endless output ends
with SIGXFSZ), open files and processes, and no network: a new network namespace where the kernel
allows one, and an audit hook that refuses sockets in every case. The hook also refuses writes outside
the directory, subprocesses, signals and ctypes.

Started by root with an interpreter every user may run, the program runs under a user id of its own:
the process limit then counts only its processes (a fork bomb stops there), it cannot write the files
of the run's user, and everything it left behind is killed at the end, even a process that left its
session. Otherwise (another user, or an interpreter under a private directory such as /root) the
audit hook refuses `fork` too, since root ignores the process limit and another user's limit would
count that user's other processes.

`preexec_fn` is not safe in a threaded parent: call `run_python` from a single-threaded process (the
reward scorer's child is one).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_FIRST_SANDBOX_UID = 1 << 20

# Runs before the program, in its interpreter: argv[1] is the program, argv[2] its directory, argv[3]
# "1" when it may fork. Audit hooks cannot be removed from Python code.
GUARD = r"""
import os, sys

def _install(root, may_fork):
    root = os.path.realpath(root)
    writes = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
              "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
    refused = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.kill",
               "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
               "os.forkpty"} | (set() if may_fork else {"os.fork"})
    flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path):
        if isinstance(path, int):
            return True
        full = os.path.realpath(os.fsdecode(path))
        return full == root or full.startswith(root + os.sep)

    def hook(event, args):
        if event.startswith("socket."):
            raise PermissionError("the sandbox has no network")
        if event in refused:
            raise PermissionError(f"{event} is not allowed in the sandbox")
        writing = event == "open" and (
            any(c in (args[1] or "") for c in "wax+") or (args[2] or 0) & flags
        )
        if writing or event in writes:
            for path in args:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"writing outside the sandbox directory: {os.fsdecode(path)}")

    sys.addaudithook(hook)

_install(sys.argv[2], sys.argv[3] == "1")
del _install
__file__ = sys.argv[1]
sys.argv = sys.argv[1:2]
with open(__file__) as _f:
    _code = compile(_f.read(), __file__, "exec")
del _f
exec(_code, {"__name__": "__main__", "__file__": __file__})
"""


@dataclass(frozen=True)
class Limits:
    """What one run may use: wall-clock seconds, address space, bytes of each output file, processes."""

    time_s: float = 5.0
    memory_mb: int = 512
    output_bytes: int = 1 << 20
    processes: int = 16


@dataclass(frozen=True)
class RunResult:
    """How a run ended: its exit code (negative: killed by that signal), its output, and whether it timed out."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _confine(libc: ctypes.CDLL, limits: Limits, uid: int | None) -> None:
    """In the child, before exec: no network, the rlimits, then its own user id and death with its parent."""
    # A failed unshare leaves the audit hook as the network barrier.
    libc.unshare(_CLONE_NEWNET if uid is not None else _CLONE_NEWUSER | _CLONE_NEWNET)
    memory = limits.memory_mb << 20
    cpu_s = math.ceil(limits.time_s) + 1
    for which, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, limits.output_bytes),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it


def _others_may_run(python: str) -> bool:
    """Whether a user without privileges can execute `python` and read its standard library beside it."""
    executable = Path(python).resolve()
    lib = executable.parent.parent / "lib"
    paths = [executable, *executable.parents, *([lib] if lib.is_dir() else [])]
    return all(path.stat().st_mode & stat.S_IXOTH for path in paths)


def _kill_all_of(uid: int) -> None:
    """Kill every process running as `uid` (kill(-1) from a helper holding that uid alone)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _read(file: IO[bytes], limit: int) -> str:
    file.seek(0)
    return file.read(limit).decode(errors="replace")


def run_python(
    code: str, stdin: str = "", limits: Limits | None = None, python: str = sys.executable, own_user: bool = True
) -> RunResult:
    """Run `code` with `stdin` by the interpreter `python` under `limits` and return how it ended.

    `own_user=False` keeps the run under the caller's user id even when that is root (the audit hook
    alone then keeps the program in its directory and refuses `fork`).
    """
    limits = limits or Limits()
    isolate = own_user and os.geteuid() == 0 and _others_may_run(python)
    uid = _FIRST_SANDBOX_UID + secrets.randbelow(1 << 29) if isolate else None
    libc = _libc()
    workdir = tempfile.mkdtemp(prefix="roll-code-")
    try:
        program = Path(workdir) / "program.py"
        program.write_text(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
        with tempfile.TemporaryFile() as stdin_file, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            may_fork = "1" if uid is not None else "0"
            process = subprocess.Popen(
                [python, "-I", "-c", GUARD, str(program), workdir, may_fork],
                stdin=stdin_file,
                stdout=out,
                stderr=err,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
                start_new_session=True,
                preexec_fn=lambda: _confine(libc, limits, uid),
            )
            try:
                returncode, timed_out = process.wait(timeout=limits.time_s), False
            except subprocess.TimeoutExpired:
                returncode, timed_out = -signal.SIGKILL, True
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # its session's leftovers, if any
                if uid is not None:
                    _kill_all_of(uid)
                process.wait()
            return RunResult(returncode, _read(out, limits.output_bytes), _read(err, limits.output_bytes), timed_out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
