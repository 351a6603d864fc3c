"""Wall time and CPU time of each test file run alone: where the whole suite's time goes.

    python benchmarks/suite_cpu.py [--write-docs] [PATH ...]

Runs each path (default: every file of tests/integration, then tests/unit as one) in a pytest process of its own
(`-n 0`, the environment `scripts/test.sh` gives, without its lint), one after another, and reports its tests, its
wall time and the CPU time the whole machine spent meanwhile (/proc/stat): the processes the tests start count
too (Ray's daemons and workers, vLLM's engines, entry points run in a shell), and so does any other work, so run
it on an otherwise idle machine. The suite runs two files at a time and keeps two cores busy, so its wall time is
about the summed CPU time divided by the cores: the column to cut. `--write-docs` rewrites the table in
docs/testing.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402

DOC = REPO_ROOT / "docs" / "testing.md"
BLOCKS = ("suite_cpu",)
# The environment of scripts/test.sh (the install check, the thread caps, DeepSpeed's prebuilt ops), then pytest.
PYTEST = 'source scripts/setup_env.sh >/dev/null && source scripts/cpu_env.sh && exec "$venv/bin/python" -m pytest "$@"'
PASSED = re.compile(r"(\d+) passed")


@dataclass(frozen=True)
class FileRun:
    """One path's run: its pytest exit code, tests passed, wall seconds and machine CPU-seconds."""

    path: str
    returncode: int
    passed: int
    wall_s: float
    cpu_s: float


def machine_cpu_s() -> float:
    """CPU-seconds the machine has spent busy since boot (/proc/stat: user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def run_alone(path: str) -> FileRun:
    """Run `path`'s tests in a pytest process of their own and measure it."""
    args = ["-n", "0", "-q", "-p", "no:cacheprovider", path]
    cpu, start = machine_cpu_s(), time.monotonic()
    done = subprocess.run(["bash", "-c", PYTEST, "pytest", *args], cwd=REPO_ROOT, capture_output=True, text=True)
    wall, cpu = time.monotonic() - start, machine_cpu_s() - cpu
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    passed = PASSED.search(summary)
    if done.returncode != 0:
        print(f"{path}: pytest exited {done.returncode}: {summary or done.stderr[-500:]}", file=sys.stderr)
    return FileRun(path, done.returncode, int(passed[1]) if passed else 0, wall, cpu)


def default_paths() -> list[str]:
    """Every integration test file, then the unit tests as one path."""
    files = sorted((REPO_ROOT / "tests" / "integration").glob("test_*.py"))
    return [str(f.relative_to(REPO_ROOT)) for f in files] + ["tests/unit"]


def table(runs: list[FileRun]) -> str:
    """The runs by CPU time, most first, then their sums and the wall time two cores would need at least."""
    lines = ["| tests | passed | wall s | CPU-s |", "|---|---:|---:|---:|"]
    for run in sorted(runs, key=lambda r: -r.cpu_s):
        status = "" if run.returncode == 0 else f" (exit {run.returncode})"
        lines.append(f"| {run.path}{status} | {run.passed} | {run.wall_s:.0f} | {run.cpu_s:.0f} |")
    cpu = sum(r.cpu_s for r in runs)
    lines.append(
        f"| **all, one at a time** | {sum(r.passed for r in runs)} | {sum(r.wall_s for r in runs):.0f} | {cpu:.0f} |"
    )
    cores = len(os.sched_getaffinity(0))
    lines.append("")
    # Each path alone pays for a pytest start and an embedded Ray, which the suite's test processes pay once each.
    lines.append(f"Summed CPU time / {cores} cores: **{cpu / cores:.0f} s**, less each path's own start-up.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line: paths to measure and --write-docs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="test files or folders (default: each integration file, tests/unit)")
    parser.add_argument(doc_tables.WRITE_DOCS, action="store_true", dest="write_docs")
    return parser


def main() -> None:
    """Measure each path, print the table, and write it into docs/testing.md with --write-docs."""
    args = build_parser().parse_args()
    runs = []
    for path in args.paths or default_paths():
        runs.append(run_alone(path))
        print(f"{path}: {runs[-1].passed} passed, {runs[-1].wall_s:.0f} s, {runs[-1].cpu_s:.0f} CPU-s", flush=True)
    text = table(runs)
    print(text)
    if args.write_docs:
        doc_tables.write_block(DOC, BLOCKS[0], doc_tables.command_line(__file__, sys.argv[1:]), text)


if __name__ == "__main__":
    main()
