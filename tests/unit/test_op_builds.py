"""Where DeepSpeed's JIT ops are looked for when scripts/setup_env.sh's variables are not set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from roll.third_party.deepspeed.op_builds import use_environment_builds


def test_the_environments_builds_are_used_unless_a_directory_was_chosen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    use_environment_builds()
    assert "TORCH_EXTENSIONS_DIR" not in os.environ  # nothing built here: torch's default stays

    (tmp_path / "torch_extensions").mkdir()
    use_environment_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "torch_extensions")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/chosen")
    use_environment_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/chosen"


def test_the_environments_ninja_comes_first_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A system ninja records other command hashes than the environment's, so finding it first rebuilt every op."""
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    use_environment_builds()
    assert os.environ["PATH"] == "/usr/bin:/bin"  # no ninja in this environment: PATH is left alone

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ninja").touch()
    use_environment_builds()
    use_environment_builds()  # idempotent: not prepended twice
    assert os.environ["PATH"] == os.pathsep.join([str(tmp_path / "bin"), "/usr/bin", "/bin"])
