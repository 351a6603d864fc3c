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
