"""The commands of the README and docs/*.md, in reading order as a newcomer runs them, in a fresh copy of the repo.

Each runs in its `Run` form from tests/readme_commands.py. Dry runs and `--help` of roll's entry points run in
this process through the functions their console scripts and scripts call (tests/in_process.py), which saves
each a Python start and its imports (about 10 s); one command per way of starting roll (each console script,
`python examples/...`, `bash scripts/...`) and every other command run in a shell where the environment is
activated, as the docs ask. The commands that train join one Ray head this test starts, instead of each
starting a Ray of its own, and the test collection runs once, the other test commands' selections checked in
its output.

The main job (`bash scripts/run.sh`) runs first, wherever the docs put it: it makes what later ones read. After
it, two lanes: one runs the shell commands in reading order; this thread runs the commands run `beside` them
(tests/readme_commands.py), in reading order, then the other in-process ones, each after the shell commands
before it. The copy shares this repository's installed `.venv/`, which must be current (else the main job would
install into it from the copy).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import pytest

from roll.cli import ENTRIES
from tests.conftest import REPO_ROOT
from tests.in_process import run_in_process
from tests.readme_commands import (
    COLLECTION,
    VERDICTS,
    Collected,
    Run,
    checks_only,
    documented_commands,
    in_process_programs,
    route,
    shell_runs,
)

pytestmark = pytest.mark.slow
VENV = Path(sys.prefix)
# Logical CPUs of the shared head: two pipelines' reservations at once (one per lane), each as large as the
# embedded Ray a run would size for itself.
HEAD_CPUS = 32
# "local": a new head even when `ray start` runs another one on this machine, which Ray would join otherwise.
HEAD = (
    f"import sys, ray; ray.init(address='local', num_cpus={HEAD_CPUS}, include_dashboard=False); "
    "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()"
)
# The routes that start a pipeline, and so Ray, unless they only check (a dry run, `--help`).
PIPELINE_ROUTES = {"python examples/", "bash scripts/run.sh", *(f"roll-{name.replace('_', '-')}" for name in ENTRIES)}
COLLECTED = re.compile(r"^(\d+)/(\d+) tests collected \((\d+) deselected\)", re.M)


@dataclass(frozen=True)
class Ran:
    """A command's end: its output (stdout, then stderr), and its failure report if it failed."""

    output: str
    failure: str | None


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


@pytest.fixture(scope="module")
def ray_head(fresh_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A local Ray head started in the copy (its workers' working directory), stopped at the end; yields the
    environment variables that make a driver join it.

    Its driver holds it: closing the driver's stdin ends the driver and the head with it. Ray turns token
    authentication on for it, which a driver joining by address must ask for.
    """
    joining = {"RAY_AUTH_MODE": "token"}
    log = tmp_path_factory.mktemp("ray_head") / "head.log"
    with log.open("w") as stderr:
        head = subprocess.Popen(
            [sys.executable, "-c", HEAD],
            cwd=fresh_copy,
            env=_environment() | joining,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        address = head.stdout.readline().strip()
        assert address, f"the Ray head did not start:\n{log.read_text()[-3000:]}"
        yield joining | {"RAY_ADDRESS": address}
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


def _environment() -> dict[str, str]:
    """This process's environment without a Ray address or an active venv, as a newcomer's shell has it, except
    that the copy's scripts may only check the shared `.venv/`: an install from the copy would point the editable
    roll of every other test at the copy."""
    kept = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV")}
    return kept | {"ROLL_INSTALL_CHECK": "1"}


def _in_shell(command: str, copy: Path, env: dict[str, str], log: TextIO) -> Ran:
    """Run `command` in an activated shell in `copy`; its time goes to `log`."""
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "-c", f"set -eo pipefail; source .venv/bin/activate; {command}"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return _ended(command, "shell", start, result.returncode, result.stdout + result.stderr, log)


def _in_process(command: str, copy: Path, env: dict[str, str], log: TextIO) -> Ran:
    """Run `command`'s entry points in this process in `copy`, one after the other until one fails (`set -e`); its
    time goes to `log`."""
    programs = in_process_programs(command)
    assert programs, command
    start, returncode, output = time.monotonic(), 0, ""
    for program in programs:
        outcome = run_in_process(program.argv, copy, env | dict(program.env))
        returncode, output = outcome.returncode, output + outcome.stdout + outcome.stderr
        if returncode != 0:
            break
    return _ended(command, "in-process", start, returncode, output, log)


def _ended(command: str, how: str, start: float, returncode: int, output: str, log: TextIO) -> Ran:
    """Write the command's time to `log` as it ends (a run stopped by the timeout still shows how far it got);
    its `Ran`."""
    print(f"{time.monotonic() - start:5.1f} s  {how:10}  {command}", file=log, flush=True)
    return Ran(output, f"$ {command}\nexit {returncode}\n{output[-2500:]}" if returncode else None)


# Every documented command: 11 min on 2 cores at a load of 5-10 (15 min with load spikes to 50), of which the
# in-process commands take 1 min.
@pytest.mark.timeout(1800)
def test_every_documented_command_runs_as_written(fresh_copy: Path, ray_head: dict[str, str]) -> None:
    commands = documented_commands(REPO_ROOT)
    runs = list(dict.fromkeys(v for v in map(VERDICTS.get, commands) if isinstance(v, Run)))
    shell = shell_runs(runs)
    env = _environment()
    joined = env | ray_head
    log = sys.stdout  # in-process commands redirect sys.stdout while the other lane reports

    def in_shell(run: Run) -> Ran:
        trains = route(run.command) in PIPELINE_ROUTES and not checks_only(run.command)
        return _in_shell(run.command, fresh_copy, joined if trains else env, log)

    main = VERDICTS["bash scripts/run.sh"]
    assert main in shell, "the main job trains, in a shell"
    rest = [run for run in runs if run != main]
    results = {main: in_shell(main)}
    with ThreadPoolExecutor(max_workers=1) as lane:
        queued: dict[Run, Future[Ran]] = {
            run: lane.submit(in_shell, run) for run in rest if run in shell and not run.beside
        }
        here = [run for run in rest if run.beside] + [run for run in rest if run not in shell and not run.beside]
        for run in here:
            if not run.beside:
                for earlier in rest[: rest.index(run)]:
                    if earlier in queued:
                        queued[earlier].result()
            results[run] = in_shell(run) if run in shell else _in_process(run.command, fresh_copy, env, log)
        results |= {run: future.result() for run, future in queued.items()}
    failures = [ran.failure for ran in results.values() if ran.failure]
    assert not failures, "\n\n".join(failures)
    _check_collected(results[Run(COLLECTION, beside=True)].output, commands)


def _check_collected(output: str, commands: list[str]) -> None:
    """The one collection deselected slow tests, and listed tests of every documented test command's selection."""
    counts = COLLECTED.search(output)
    assert counts and int(counts[1]) > 0 and int(counts[3]) > 0, output[-2000:]
    listed = [line for line in output.splitlines() if "::" in line]
    for command in commands:
        verdict = VERDICTS.get(command)
        if isinstance(verdict, Collected):
            assert any(test.startswith(verdict.prefix) for test in listed), f"{command}: no test under {verdict.prefix}"
