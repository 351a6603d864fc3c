"""transformers' import-time scans come from roll's cache: the same answers, recomputed when the files change."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers.utils.import_utils as import_utils

from roll.third_party.transformers import import_scans
from tests.conftest import REPO_ROOT

MODELS = Path(import_utils.__file__).parent.parent / "models"
# transformers' own function: this process may have imported transformers through the cache
DEFINE = import_utils.define_import_structure
if getattr(DEFINE, "roll_cached", False):
    DEFINE = DEFINE.__wrapped__


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """roll's cache directory, empty, in `tmp_path`; the folder the scans are stored in."""
    monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path))
    return tmp_path / import_scans.CACHE_FOLDER


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A package folder of two modules, the kind of folder `define_import_structure` reads."""
    root = tmp_path / "package"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("__all__ = ['A']\n")
    (root / "sub" / "b.py").write_text("__all__ = ['B']\n")
    return root


def counting(calls: list[str]):
    """A stand-in for transformers' `define_import_structure` that records each folder it scans."""

    def define(module_path, prefix=None):
        calls.append(str(module_path))
        return {frozenset(): {f"{prefix}.a": {"A"}}, frozenset({"torch"}): {"sub.b": {"B", "C"}}}

    return define


def test_transformers_models_table_is_the_same_from_the_cache(cache: Path) -> None:
    define = import_scans.cached_import_structure(DEFINE)
    computed = define(MODELS, prefix="models")
    assert len(list(cache.glob("structure-*.json"))) == 1
    read = define(MODELS, prefix="models")
    assert read == computed == DEFINE(MODELS, prefix="models")
    assert read is not computed  # transformers adds to the table it gets: each call gets its own
    assert define(MODELS / "__init__.py") == DEFINE(MODELS / "__init__.py")


def test_a_scan_is_read_until_a_module_changes(cache: Path, package: Path) -> None:
    calls: list[str] = []
    define = import_scans.cached_import_structure(counting(calls))
    first = define(package, prefix="p")
    assert define(package, prefix="p") == first and len(calls) == 1
    assert define(package, prefix="q")[frozenset()] == {"q.a": {"A"}} and len(calls) == 2

    import_scans.source_fingerprint.cache_clear()  # a new process
    (package / "sub" / "b.py").write_text("__all__ = ['B', 'C']\n")
    define(package, prefix="p")
    assert len(calls) == 3

    import_scans.source_fingerprint.cache_clear()
    (package / "sub" / "c.py").write_text("")
    define(package, prefix="p")
    assert len(calls) == 4


@pytest.mark.parametrize("damage", ["{not json", '{"a": 1}', '[{"backends": "torch", "modules": {}}]', "[3]"])
def test_a_damaged_entry_is_scanned_again_and_replaced(cache: Path, package: Path, damage: str) -> None:
    calls: list[str] = []
    define = import_scans.cached_import_structure(counting(calls))
    expected = define(package)
    (entry,) = cache.glob("structure-*.json")
    entry.write_text(damage)
    assert define(package) == expected and len(calls) == 2
    assert import_scans.structure_from_json(json.loads(entry.read_text())) == expected


@pytest.mark.parametrize("names", [{("not", "a string")}, {"a", ("b",)}, {1.5}])
def test_a_table_json_cannot_hold_is_returned_and_not_stored(cache: Path, package: Path, names: set) -> None:
    table = {frozenset(): {"a": names}}
    scans: list[str] = []

    def scan(module_path: str, prefix: str | None = None) -> dict:
        scans.append(module_path)
        return table

    define = import_scans.cached_import_structure(scan)
    assert define(package) is table and len(scans) == 1  # scanned once, though not stored
    assert not list(cache.glob("structure-*.json"))


def test_an_unwritable_cache_still_answers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, package: Path) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path / "file"))
    calls: list[str] = []
    define = import_scans.cached_import_structure(counting(calls))
    assert define(package) == define(package) and len(calls) == 2


def test_distributions_come_from_the_cache_until_one_is_installed(
    monkeypatch: pytest.MonkeyPatch, cache: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site)])
    answers: list[dict] = []

    def packages_distributions() -> dict[str, list[str]]:
        answers.append({"yaml": ["PyYAML"], "roll": ["roll"]})
        return answers[-1]

    monkeypatch.setattr(importlib.metadata, "packages_distributions", packages_distributions)
    for _ in range(2):
        with import_scans.cached_packages_distributions():
            assert importlib.metadata.packages_distributions() == answers[0]
    assert len(answers) == 1
    assert importlib.metadata.packages_distributions is packages_distributions  # put back

    (site / "six-1.17.0.dist-info").mkdir()
    with import_scans.cached_packages_distributions():
        importlib.metadata.packages_distributions()
    assert len(answers) == 2

    for entry in cache.glob("distributions-*.json"):
        entry.write_text('["a list"]')
    with import_scans.cached_packages_distributions():
        assert importlib.metadata.packages_distributions() == answers[-1]


def test_a_new_process_imports_transformers_through_the_cache(tmp_path: Path) -> None:
    # Imports roll, then transformers, as a Ray worker does, and compares with transformers' own answers.
    program = """
import importlib.metadata, sys
import roll
import transformers
from transformers import AutoTokenizer
from transformers.utils import import_utils
assert 'roll.third_party' not in repr(sys.meta_path), 'the finder stays after the import'
assert getattr(import_utils.define_import_structure, 'roll_cached', False), 'not read through the cache'
assert import_utils.PACKAGE_DISTRIBUTION_MAPPING == importlib.metadata.packages_distributions()
print(AutoTokenizer.__module__)
"""
    env = {**os.environ, "ROLL_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", program], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "transformers.models.auto.tokenization_auto"
    stored = sorted(path.name.split("-")[0] for path in (tmp_path / import_scans.CACHE_FOLDER).iterdir())
    assert "distributions" in stored and stored.count("structure") >= 2, stored
