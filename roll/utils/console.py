"""What a run prints, and what goes to its log file instead.

The console shows the plan, the progress line (or bar, with the latest evaluation), milestones (checkpoints, the
export), warnings and errors. Every other record goes to the run's log file, `<run_dir>/logs/run.log` (appended to,
one header per start), which the console names at the start. Worker processes follow the same rule in their own
process: the libraries' loggers (DeepSpeed, transformers, accelerate, torch.distributed, Ray) stay at WARNING where
they are made, transformers and huggingface_hub draw no progress bars, roll's own records go to
`<run_dir>/logs/workers.log`, and only warnings and errors reach the worker's stderr, which Ray forwards to the
driver's console.

Verbose brings the detail back to the console: every record at INFO and above, the libraries' included, in the
driver and in the workers. It is Hydra's `hydra.verbose`: `-v` is short for `hydra.verbose=roll` (roll's
loggers at DEBUG), `hydra.verbose=true` puts every logger at DEBUG, `hydra.verbose=[<logger>,...]` those named.

A record is a milestone when logged with `extra=MILESTONE`: shown on the console at INFO.
"""

from __future__ import annotations

import contextlib
import io
import logging
import logging.handlers
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# `logger.info(..., extra=MILESTONE)`: a record the console shows although it is not a warning.
MILESTONE = {"milestone": True}

# The libraries whose records are detail: in a worker their INFO is not even logged unless verbose (warnings
# still show); in the driver it goes to the run's log file.
LIBRARY_LOGGERS = (
    "DeepSpeed",  # deepspeed.utils.logger
    "deepspeed",
    "transformers",
    "accelerate",
    "torch.distributed",
    "torch._dynamo",
    "ray",
    "datasets",
    "huggingface_hub",
    "httpx",
    "urllib3",
    "filelock",
)

# What the driver hands its workers (in Ray's runtime environment): verbose or not, and the workers' log file.
VERBOSE_ENV = "ROLL_VERBOSE"
WORKER_LOG_ENV = "ROLL_WORKER_LOG"

FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WORKER_FILE_FORMAT = "%(asctime)s %(levelname)s pid %(process)d %(name)s: %(message)s"


# Warnings that ask nothing of the user, by where they are logged (logger, function): detail, for the log file.
# Ray's note that it turned token authentication on for a new local cluster, its default (the setting is
# cached in the driver's process, so choosing it with RAY_AUTH_MODE there leaves Ray's client without it).
INFORMATIONAL_WARNINGS = frozenset(
    {("ray._private.authentication.authentication_token_setup", "_warn_token_auth_enabled")}
)


class ConsoleFilter(logging.Filter):
    """Passes warnings and errors (but `INFORMATIONAL_WARNINGS`), and milestones (records logged with
    `extra=MILESTONE`); everything when `verbose`."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose or getattr(record, "milestone", False):
            return True
        return record.levelno >= logging.WARNING and (record.name, record.funcName) not in INFORMATIONAL_WARNINGS


class ConsoleFormatter(logging.Formatter):
    """A milestone as its message alone; a warning or an error with its level and logger; detail (verbose) as the
    log file writes it."""

    def __init__(self) -> None:
        super().__init__(FILE_FORMAT)
        self.short = logging.Formatter("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "milestone", False):
            return record.getMessage()
        if record.levelno >= logging.WARNING:
            return self.short.format(record)
        return super().format(record)


def debug_loggers(hydra_verbose: object) -> list[str]:
    """The loggers Hydra's `hydra.verbose` puts at DEBUG: all ("", the root) for true, else the names it gives
    (a name or a list of names); a run is verbose when there is any."""
    if isinstance(hydra_verbose, bool) or hydra_verbose is None:
        return [""] if hydra_verbose else []
    if isinstance(hydra_verbose, str):
        return [hydra_verbose] if hydra_verbose else []
    return [str(name) for name in hydra_verbose]  # type: ignore[attr-defined]  # a list of names


def verbose_args(argv: Sequence[str]) -> list[str]:
    """Command-line arguments with `-v` / `--verbose` spelled as a Hydra override, `hydra.verbose=roll`: the
    detail on the console, roll's loggers at DEBUG (`hydra.verbose=true` puts every logger at DEBUG)."""
    out = [arg for arg in argv if arg not in ("-v", "--verbose")]
    if len(out) != len(argv) and not any(arg.startswith("hydra.verbose=") for arg in out):
        out.append("hydra.verbose=roll")
    return out


def set_library_levels(verbose: bool) -> None:
    """The libraries' loggers at WARNING (INFO when verbose), with the handlers of their own (DeepSpeed's)."""
    level = logging.INFO if verbose else logging.WARNING
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.setLevel(level)
        for handler in library.handlers:
            handler.setLevel(level)
    if "transformers" in sys.modules:  # imported before: its verbosity (read from the environment at import) too
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(level)
        if not verbose:
            transformers_logging.disable_progress_bar()


def worker_env(driver_env: dict[str, str] | os._Environ[str] | None = None) -> dict[str, str]:
    """The variables a worker process starts with, so its libraries are quiet from their first import: no
    transformers or huggingface_hub progress bars, transformers at WARNING (all of it when verbose), and where
    roll's records go (`ROLL_WORKER_LOG`, from the driver's run logging)."""
    driver_env = os.environ if driver_env is None else driver_env
    verbose = driver_env.get(VERBOSE_ENV) == "1"
    env = {VERBOSE_ENV: "1" if verbose else "0", "TRANSFORMERS_VERBOSITY": "info" if verbose else "warning"}
    if not verbose:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if driver_env.get(WORKER_LOG_ENV):
        env[WORKER_LOG_ENV] = driver_env[WORKER_LOG_ENV]
    return env


_worker_handlers: list[logging.Handler] = []


def configure_worker_logging(env: dict[str, str] | os._Environ[str] | None = None) -> None:
    """In a worker process: warnings and errors to stderr (which Ray forwards to the driver's console), roll's
    INFO records to the workers' log file, the libraries quiet (`set_library_levels`); everything to stderr when
    verbose. Calling it again (a second role in the same process) changes nothing, and so does calling it in a
    process the driver did not start as a worker (no `ROLL_VERBOSE`: a test building a worker in its own process).
    """
    env = os.environ if env is None else env
    if _worker_handlers or VERBOSE_ENV not in env:
        return
    verbose = env.get(VERBOSE_ENV) == "1"
    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(ConsoleFilter(verbose))
    console.setFormatter(ConsoleFormatter())
    _worker_handlers.append(console)
    path = env.get(WORKER_LOG_ENV)
    if path:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            file = logging.FileHandler(path, encoding="utf-8", delay=True)
        except OSError as exc:  # a node that cannot write the driver's path: the detail stays in Ray's worker log
            console.handle(logging.makeLogRecord({"msg": f"workers' log file {path}: {exc}", "levelno": 30}))
        else:
            file.setFormatter(logging.Formatter(WORKER_FILE_FORMAT))
            _worker_handlers.append(file)
    for handler in _worker_handlers:
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    set_library_levels(verbose)


@contextlib.contextmanager
def prints_to_log(name: str) -> Iterator[None]:
    """What a library prints to stdout inside the block (DeepSpeed's "... built successfully" when it loads an op)
    as INFO records of logger `name`: detail, like its other records."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        for line in printed.getvalue().splitlines():
            if line.strip():
                logging.getLogger(name).info(line)


def reapply_library_levels() -> None:
    """In a configured worker, the libraries' levels again: after importing one that sets its own when imported
    (DeepSpeed's logger is made at WARNING), so a verbose run still gets its detail."""
    if _worker_handlers:
        set_library_levels(os.environ.get(VERBOSE_ENV) == "1")


def _transformers_bars(enabled: bool | None) -> bool | None:
    """Turn transformers' own progress bars (weights written or loaded) on or off (None: leave them); whether they
    were on. Hugging Face hub downloads keep theirs."""
    if enabled is None:
        return None
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    was, hub_disabled = transformers_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    if enabled:
        transformers_logging.enable_progress_bar()
    else:
        transformers_logging.disable_progress_bar()
    (disable_progress_bars if hub_disabled else enable_progress_bars)()  # transformers switches the hub's too
    return was


class RunLogs:
    """The driver's logging for one run (see `run_logging`): records wait in memory until `to_file` names the
    run's log file."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.path: Path | None = None
        self.console = logging.StreamHandler(sys.stderr)
        self.console.addFilter(ConsoleFilter(verbose))
        self.console.setFormatter(ConsoleFormatter())
        self.pending = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
        self.file: logging.FileHandler | None = None
        self.bars_were_on: bool | None = None  # transformers' progress bars, before `to_file` turned them off

    def to_file(self, path: Path, header: str) -> Path:
        """Write the records so far and every later one to `path` (appended, after `header`), tell the workers to
        write theirs beside it (`workers.log`), and (unless verbose) turn transformers' progress bars off until the
        run ends. Returns the path."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as out:
            out.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n")
        self.file = logging.FileHandler(path, encoding="utf-8")
        self.file.setFormatter(logging.Formatter(FILE_FORMAT))
        self.pending.setTarget(self.file)
        self.pending.flush()
        root = logging.getLogger()
        root.removeHandler(self.pending)
        root.addHandler(self.file)
        # Absolute: a worker's working directory need not be the driver's.
        os.environ[WORKER_LOG_ENV] = os.path.abspath(path.parent / "workers.log")
        if not self.verbose and self.bars_were_on is None:
            self.bars_were_on = _transformers_bars(False)  # the driver writes and loads models too (tiny://)
        self.path = path
        return path


@contextlib.contextmanager
def run_logging(verbose: bool, debug_loggers: Sequence[str] = ()) -> Iterator[RunLogs]:
    """The driver's logging while a run lasts: the console shows warnings, errors and milestones (everything
    when `verbose`), the run's log file every record at INFO and above (`RunLogs.to_file`), the libraries'
    included; the loggers named in `debug_loggers` ("" for all) at DEBUG. Hydra's handlers, the loggers' levels,
    the "ray" logger and the variables the workers inherit are put back afterwards."""
    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    saved_root = (list(root.handlers), root.level)
    saved_ray = (list(ray_logger.handlers), ray_logger.propagate, ray_logger.level)
    saved_levels = {name: logging.getLogger(name).level for name in debug_loggers}
    saved_env = {name: os.environ.get(name) for name in (VERBOSE_ENV, WORKER_LOG_ENV)}
    logs = RunLogs(verbose)
    root.handlers[:] = [logs.console, logs.pending]
    root.setLevel(logging.INFO)
    # Ray's driver logger writes to a handler of its own: its records ("Started a local Ray instance", ...) join
    # the others, so they reach the log file, and the console only when they are warnings.
    ray_logger.handlers[:] = []
    ray_logger.propagate = True
    for name in debug_loggers:
        logging.getLogger(name).setLevel(logging.DEBUG)
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    try:
        yield logs
    finally:
        _transformers_bars(logs.bars_were_on)
        for handler in (logs.console, logs.pending, logs.file):
            if handler is not None:
                handler.close()
        root.handlers[:], level = saved_root
        root.setLevel(level)
        ray_logger.handlers[:], ray_logger.propagate, ray_level = saved_ray
        ray_logger.setLevel(ray_level)
        for name, saved in saved_levels.items():
            logging.getLogger(name).setLevel(saved)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
