"""Small file helpers that never leave a half-written file behind."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _as_is(value: Any) -> Any:
    return value


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: readers see the old content or the new, never a part.

    Each writer stages its text in a file of its own, so processes writing the same path at once (cache entries)
    cannot interleave."""
    # not tempfile.mkstemp: its files are private (0600), and a checkpoint's files keep the umask's permissions
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_or_compute_json(path: Path, compute: Callable[[], Any], decode: Callable[[Any], T] = _as_is) -> T:
    """`decode` of the JSON value stored at `path`, else of `compute()`, which is stored there whole when not empty.

    For caches: an unreadable file, or one whose value `decode` rejects (ValueError or TypeError), is computed
    again and replaced; a cache that cannot be written costs the computation next time, nothing else."""
    try:
        return decode(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    value = compute()
    decoded = decode(value)
    if value:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, json.dumps(value))
        except OSError:
            pass
    return decoded


PID_DIR_ENV = "ROLL_PID_DIR"


def write_pid_file(label: str) -> None:
    """With `ROLL_PID_DIR` set, write this process's pid to `<dir>/<label>.pid`, for tools outside the run that
    watch or kill it (tests, benchmarks/scale_memory.py, benchmarks/chaos.py)."""
    pid_dir = os.environ.get(PID_DIR_ENV)
    if pid_dir:
        (Path(pid_dir) / f"{label}.pid").write_text(str(os.getpid()))


def read_latest_tag(root: Path, latest_name: str = "latest") -> str:
    """The tag that `root/latest` names; FileNotFoundError naming `root` when there is none."""
    latest = root / latest_name
    if not latest.is_file():
        raise FileNotFoundError(f"no complete checkpoint in {root}: there is no '{latest_name}' file")
    return latest.read_text().strip()


def cache_root(cache_dir: str | None = None) -> Path:
    """roll's cache directory: `cache_dir`, else `$ROLL_CACHE_DIR`, else `~/.cache/roll`."""
    return Path(cache_dir or os.environ.get("ROLL_CACHE_DIR") or Path.home() / ".cache" / "roll")


def unwritable_reason(path: str | Path) -> str | None:
    """Why directory `path` could not be created and written to (None: it could): a file in its place or on its
    way, a place inside roll's cache, whose entries are shared by every run and rebuilt when anything changes them,
    or a folder that refuses a new entry (no permission, a read-only filesystem, /proc). Nothing is left behind:
    the last check creates an empty folder in the nearest existing one and removes it."""
    existing = Path(path).expanduser().absolute()
    cache = cache_root().expanduser().absolute()
    if existing == cache or cache in existing.parents:
        return f"it is inside roll's model cache {cache}, whose built entries every run shares"
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".roll-write-check-", dir=existing))
    except OSError as exc:
        return f"{existing} refuses new folders ({exc.strerror or exc})"
    return None
