"""Two scans that `import transformers` repeats in every process, read from roll's cache instead.

transformers builds its lazy import table by reading the source of every model module (about 1,500
files under `transformers/models`), and asks `importlib.metadata.packages_distributions()` for the
file lists of every installed distribution. Together that is about a CPU-second in each process
that imports transformers: each Ray worker, each entry point. Both results depend only on files on
disk, so they are kept in roll's cache directory as JSON, under a fingerprint of those files:

- the import table under each model module's path, size and modification time;
- the distributions under the names and modification times of their metadata folders on
  `sys.path` (a folder's name holds its version, so installing, upgrading or removing one changes it).

A missing, unreadable or stale entry is computed as transformers would and written again. Only
processes that import roll before transformers use the cache (Ray workers and roll's entry points
do). `ROLL_TRANSFORMERS_IMPORT_CACHE=0` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

from roll.utils.fileio import cache_root, read_or_compute_json

SWITCH_ENV = "ROLL_TRANSFORMERS_IMPORT_CACHE"
IMPORT_UTILS = "transformers.utils.import_utils"
CACHE_FOLDER = "transformers-imports"

# {backends: {module: names}}, as transformers.utils.import_utils.define_import_structure returns it
ImportStructure = dict[frozenset[str], dict[str, set[str]]]


def install() -> None:
    """Make this process's first `import transformers` read both scans from the cache.

    Does nothing once transformers is imported (its scans are done), when the switch is off, or when
    already installed."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or "transformers" in sys.modules:
        return
    if not any(isinstance(finder, _ImportUtilsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ImportUtilsFinder())


class _ImportUtilsFinder(importlib.abc.MetaPathFinder):
    """Finds `transformers.utils.import_utils` as Python would, with a loader that adds the caches."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != IMPORT_UTILS:
            return None
        sys.meta_path.remove(self)  # the module loads once per process
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _CachingLoader(spec.loader.name, spec.loader.path)
        return spec


class _CachingLoader(importlib.machinery.SourceFileLoader):
    """Runs transformers' module with the distributions from the cache, then caches its import tables."""

    def exec_module(self, module: ModuleType) -> None:
        with cached_packages_distributions():
            super().exec_module(module)
        module.define_import_structure = cached_import_structure(module.define_import_structure)


@contextlib.contextmanager
def cached_packages_distributions() -> Iterator[None]:
    """`importlib.metadata.packages_distributions` answers from the cache while the context is open."""
    import importlib.metadata  # here, not at the top: `import roll` stays light

    original = importlib.metadata.packages_distributions

    def cached() -> dict[str, list[str]]:
        path = cache_root() / CACHE_FOLDER / f"distributions-{sys_path_fingerprint()}.json"
        return read_or_compute_json(path, original, distributions_from_json)

    importlib.metadata.packages_distributions = cached
    try:
        yield
    finally:
        importlib.metadata.packages_distributions = original


def cached_import_structure(
    define: Callable[..., ImportStructure],
) -> Callable[..., ImportStructure]:
    """`define` (transformers' `define_import_structure`), its results read from and written to the cache."""

    @functools.wraps(define)
    def define_cached(module_path: str | os.PathLike, prefix: str | None = None) -> ImportStructure:
        folder = Path(module_path)
        if folder.is_file():
            folder = folder.parent
        key = hashlib.sha256(f"{source_fingerprint(folder)}\0{prefix}".encode()).hexdigest()[:32]
        path = cache_root() / CACHE_FOLDER / f"structure-{key}.json"
        scan = functools.cache(functools.partial(define, module_path, prefix))  # at most one scan per call
        try:
            return read_or_compute_json(path, lambda: structure_to_json(scan()), structure_from_json)
        except (TypeError, ValueError):  # a table JSON cannot hold: not stored (transformers' lru_cache has it)
            return scan()

    define_cached.roll_cached = True  # type: ignore[attr-defined]
    return define_cached


@functools.cache
def source_fingerprint(folder: Path) -> str:
    """A digest of every `.py` file's path, size and modification time under `folder`."""
    digest = hashlib.sha256()
    pending = [str(folder)]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in sorted(entries, key=lambda entry: entry.name):
                if entry.is_dir() and entry.name != "__pycache__":
                    pending.append(entry.path)
                elif entry.name.endswith(".py"):
                    stat = entry.stat()
                    digest.update(f"{entry.path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def sys_path_fingerprint() -> str:
    """A digest of this interpreter and of the distributions' metadata folders in each `sys.path` folder, with their
    modification times: what `packages_distributions` reads (a folder's name holds its distribution's version)."""
    digest = hashlib.sha256(sys.version.encode())
    for entry in sys.path:
        with contextlib.suppress(OSError), os.scandir(entry or ".") as entries:
            for item in sorted(entries, key=lambda item: item.name):
                if item.name.endswith((".dist-info", ".egg-info")):
                    digest.update(f"{item.path}\0{item.stat().st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def structure_to_json(structure: ImportStructure) -> list[dict]:
    """The import table as JSON: a list of `{"backends": [...], "modules": {module: [names]}}`.

    TypeError or ValueError when it holds anything but strings, which JSON would not give back as they were."""
    groups = [
        {"backends": sorted(backends), "modules": {module: sorted(names) for module, names in modules.items()}}
        for backends, modules in structure.items()
    ]
    if structure_from_json(groups) != structure:
        raise ValueError("the import table holds more than strings")
    return groups


def structure_from_json(stored: object) -> ImportStructure:
    """The import table `structure_to_json` wrote, in transformers' types; ValueError when it is anything else."""
    if not isinstance(stored, list):
        raise ValueError("an import table is a list of groups")
    structure: ImportStructure = {}
    for group in stored:
        backends, modules = (group.get("backends"), group.get("modules")) if isinstance(group, dict) else (0, 0)
        if not (_strings(backends) and isinstance(modules, dict) and all(map(_strings, modules.values()))):
            raise ValueError(f"not an import table group: {group!r:.200}")
        structure[frozenset(backends)] = {str(module): set(names) for module, names in modules.items()}
    return structure


def distributions_from_json(stored: object) -> dict[str, list[str]]:
    """The map `packages_distributions` returns, as JSON gave it back; ValueError when it is anything else."""
    if not (isinstance(stored, dict) and all(map(_strings, stored.values()))):
        raise ValueError("a distribution map is {package: [distributions]}")
    return stored


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)
