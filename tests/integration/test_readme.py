"""The README's commands, top to bottom as a newcomer runs them, in a fresh copy of the repository.

Each runs in its `Run` form from tests/readme_commands.py (the command itself, or a cheap form of
it) in a shell where the environment is activated, as the README asks. The copy shares this
repository's installed `.venv/`, which must be current (else the README's first command would
install into it from the copy).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.readme_commands import VERDICTS, Run, read_readme

pytestmark = pytest.mark.slow
VENV = Path(sys.prefix)


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files as a clone has them (committed or not, ignored ones left out), sharing its .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    copy = tmp_path_factory.mktemp("readme") / "roll"
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    (copy / ".venv").symlink_to(VENV)
    current = subprocess.run(
        ["bash", "-c", "source scripts/setup_env.sh"], cwd=copy, env=os.environ | {"ROLL_INSTALL_CHECK": "1"}
    )
    assert current.returncode == 0, "install the environment first: bash scripts/setup_env.sh"
    return copy


def test_every_readme_command_runs_as_written(fresh_copy: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV")}
    failures, timings, done = [], [], set()
    for command in read_readme(REPO_ROOT):
        verdict = VERDICTS[command]
        if not isinstance(verdict, Run) or verdict.command in done:
            continue
        done.add(verdict.command)
        start = time.monotonic()
        result = subprocess.run(
            ["bash", "-c", f"set -eo pipefail; source .venv/bin/activate; {verdict.command}"],
            cwd=fresh_copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        timings.append(f"{time.monotonic() - start:5.1f} s  {verdict.command}")
        if result.returncode != 0:
            failures.append(f"$ {verdict.command}\nexit {result.returncode}\n{(result.stdout + result.stderr)[-2500:]}")
    print("\n".join(timings))
    assert not failures, "\n\n".join(failures)
