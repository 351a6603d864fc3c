"""The README's commands, top to bottom as a newcomer runs them, in a fresh copy of the repository.

Each runs in its `Run` form from tests/readme_commands.py (the command itself, or a cheap form of
it) in a shell where the environment is activated, as the README asks; standalone ones (dry runs,
`--help`, test collection) run in a second lane beside the others, which halves their cost on two
cores. The copy shares this repository's installed `.venv/`, which must be current (else the
README's first command would install into it from the copy).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


def _run(command: str, copy: Path, env: dict[str, str]) -> tuple[str, str | None]:
    """Run `command` in an activated shell in `copy`; return its timing line and its failure report, if any."""
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "-c", f"set -eo pipefail; source .venv/bin/activate; {command}"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    timing = f"{time.monotonic() - start:5.1f} s  {command}"
    print(timing, flush=True)  # as each ends: a run stopped by the timeout still shows how far it got
    if result.returncode == 0:
        return timing, None
    return timing, f"$ {command}\nexit {result.returncode}\n{(result.stdout + result.stderr)[-2500:]}"


# Every README command in turn: about 10 min on an idle machine, more beside the suite's other lane.
@pytest.mark.timeout(1800)
def test_every_readme_command_runs_as_written(fresh_copy: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV")}
    runs = list(dict.fromkeys(v for v in map(VERDICTS.get, read_readme(REPO_ROOT)) if isinstance(v, Run)))
    # The first command (the main job) makes what later ones read: the SFT export, the tiny model. After it,
    # the standalone commands run in a second lane while the rest keep README order in this one.
    first, *rest = runs
    results = [_run(first.command, fresh_copy, env)]
    with ThreadPoolExecutor(max_workers=1) as beside:
        standalone = [beside.submit(_run, r.command, fresh_copy, env) for r in rest if r.standalone]
        results += [_run(r.command, fresh_copy, env) for r in rest if not r.standalone]
        results += [future.result() for future in standalone]
    failures = [failure for _, failure in results if failure]
    assert not failures, "\n\n".join(failures)
