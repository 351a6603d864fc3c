"""Directories built once and reused (tiny models, tiny diffusion models): a marker that vouches for every file, and
a cache whose entries appear whole or not at all.

A build marker names what was built (the builder's identity: its version, spec, seed) and lists every file of the
directory with its size. It is written last, and it is trusted only while each listed file is still there with
that size: a directory that a crash, a concurrent writer or a user's `rm` left incomplete is rebuilt, never used.
Cache entries are built in a temporary directory beside their final name and renamed into place.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from roll.utils.fileio import cache_root, write_text_atomically


def write_marker(directory: Path, marker_name: str, identity: dict[str, Any]) -> None:
    """Vouch for `directory` as built with `identity`: record it and the size of every file, atomically."""
    files = {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != marker_name
    }
    write_text_atomically(directory / marker_name, json.dumps({"identity": identity, "files": files}, indent=2))


def read_marker(directory: Path, marker_name: str) -> dict[str, Any] | None:
    """The identity `directory`'s marker vouches for; None when the marker is missing or unreadable, or when a file
    it lists is gone or has another size (the directory is then rebuilt)."""
    try:
        marker = json.loads((directory / marker_name).read_text())
        files, identity = marker["files"], marker["identity"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for name, size in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return identity


def build_in_cache(
    kind: str,
    spec: Any,
    seed: int,
    build: Callable[[Path], Path],
    marker: tuple[str, dict[str, Any]],
    cache_dir: str | None = None,
) -> str:
    """The cache entry of dataclass `spec` and `seed` under `<cache root>/<kind>`, built by `build(directory)` unless
    the entry's `marker` (file name, identity the build writes there) vouches that it is there and whole.

    A file lock makes concurrent workers build it once. The build writes a temporary directory that is renamed into
    place when complete, so no reader ever sees a partial entry; an entry found incomplete is replaced.
    """
    root = cache_root(cache_dir) / kind
    name = "-".join(f"{k}{v}" for k, v in sorted(asdict(spec).items())) + f"-seed{seed}"
    entry = root / name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if read_marker(entry, marker[0]) == marker[1]:
            return str(entry)
        staging = root / f".{name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        build(staging)
        if entry.exists():  # incomplete or outdated: moved aside first, since a rename cannot replace a full folder
            stale = root / f".{name}.stale-{os.getpid()}"
            os.replace(entry, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, entry)
        return str(entry)
