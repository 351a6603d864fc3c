"""Ending a process without CPython's teardown of its objects.

At a normal exit CPython frees every module and object one by one. In a process that imported torch,
transformers and DeepSpeed that takes more CPU time than anything the process does in its last seconds (figures
in docs/performance.md), while the operating system frees the memory of a process at once. The functions here
end a process with everything a normal exit does that anyone outside it can see (non-daemon threads joined,
`atexit` handlers run: logging's flush, Ray's disconnect, coverage.py's data, multiprocessing's children,
`weakref.finalize` callbacks; stdout and stderr flushed), then call `os._exit`, which skips the teardown.

What is lost is only what a normal exit would do in objects' finalizers beyond that, such as an open file that
nothing closed or flushed: roll closes its files itself.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def run_as_program(main: Callable[[], object]) -> NoReturn:
    """Call `main` as a program's body, then end the process with the status its end gives (0 on return, the
    status of a `sys.exit`) without the teardown. An exception other than `SystemExit` ends the process the normal
    way, with its traceback."""
    try:
        main()
    except SystemExit as exc:
        end_process(exit_status(exc))
    end_process(0)


def exit_status(exc: SystemExit) -> int:
    """The status a Python process ends with on `exc`: its code, 0 for None, or 1 for another object (which it
    prints to stderr, as Python does)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def end_process(code: int) -> NoReturn:
    """End this process now with exit status `code`, as a normal exit would but without the teardown."""
    # The interpreter's own first step at exit: runs `threading._register_atexit` callbacks (thread pools stop
    # their threads) and joins the non-daemon threads. Private, so a Python without it exits normally.
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is None:
        sys.exit(code)
    shutdown_threads()
    _run_handlers_then_exit(code)


def skip_teardown_at_exit() -> None:
    """Make this process's coming normal exit skip the teardown, with exit status 0: for a process whose exit is
    started from outside once its work is done (a Ray actor asked to exit).

    The `atexit` handlers registered before this call would run after its handler; the handler runs them
    first, in the order a normal exit would."""
    atexit.unregister(_end_at_exit)
    atexit.register(_end_at_exit)


def _end_at_exit() -> None:
    """The `atexit` handler of `skip_teardown_at_exit`: the other handlers, then the end of the process."""
    atexit.unregister(_end_at_exit)
    _run_handlers_then_exit(0)


def _run_handlers_then_exit(code: int) -> NoReturn:
    """The steps both ends share once threads are joined: the `atexit` handlers, the flush of stdout and stderr
    (a closed one, or one whose reader is gone, is left as a normal exit leaves it), `os._exit(code)`."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
