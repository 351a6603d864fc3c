"""Step time and peak memory of the default RLVR job with actor_train on DeepSpeed ZeRO-3 and on FSDP2.

    python benchmarks/training_backends.py [--model small|medium] [--steps 8] [--skip 2]
        [--backends zero3 fsdp2 ...] [--write-docs] [hydra overrides ...]

For each backend it runs the job of benchmarks/rlvr_step_breakdown.py (examples/config/rlvr_arithmetic.yaml,
actor_train on 2 ranks, no evaluation) with only actor_train's strategy swapped, and reports the mean seconds of
the training phase and of the whole step (the first `--skip` steps left out), and the peak resident memory of the
run's Ray worker processes (the kernel's VmHWM of each worker the benchmark's embedded Ray started, sampled until
the run ends): the largest one, their number and their sum. The roles share their processes
(`share_worker_processes`), so a process's peak holds the generation and reference roles too; they are the same
for every backend, so the differences are the trainer's. `--model medium` is the 23.7M-parameter shape; a larger
one is a `pretrain=` override (a `tiny://` shape or a checkpoint). `--write-docs` rewrites this model's table in
docs/configuration.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import ray

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables, rlvr_step_breakdown  # noqa: E402

DOC = REPO_ROOT / "docs" / "configuration.md"
BLOCK_OF_MODEL = {"small": "training_backends", "medium": "training_backends-medium"}
BLOCKS = tuple(BLOCK_OF_MODEL.values())
# Backend name -> actor_train's strategy: its name and its block of examples/config.
BACKENDS: dict[str, tuple[str, str]] = {
    "zero3": ("deepspeed_train", "deepspeed_zero3"),
    "zero3_cpuoffload": ("deepspeed_train", "deepspeed_zero3_cpuoffload"),
    "fsdp2": ("fsdp2_train", "fsdp2"),
    "fsdp2_cpuoffload": ("fsdp2_train", "fsdp2_cpuoffload"),
}
TRAIN_PHASE = "time/actor_update_s"
PACKAGES = ("torch", "deepspeed", "transformers", "ray")
KIB = 1024


class WorkerPeaks:
    """Samples the peak resident memory (VmHWM) of the Ray worker processes this process started, in a thread."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.peaks: dict[int, int] = {}
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> WorkerPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._done.wait(self._interval_s):
            for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
                peak = _worker_peak_bytes(pid)
                if peak and _descends_from(pid, os.getpid()):
                    self.peaks[pid] = max(peak, self.peaks.get(pid, 0))


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is among `pid`'s parents (the embedded Ray's raylet started the run's workers)."""
    try:
        while pid > 1:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if pid == ancestor:
                return True
    except (FileNotFoundError, ProcessLookupError):
        pass  # an ancestor ended meanwhile
    return False


def _worker_peak_bytes(pid: int) -> int:
    """VmHWM of `pid` in bytes if it is a Ray worker process (its title starts with `ray::`), else 0."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
        if not title.startswith(b"ray::") or title.startswith((b"ray::IDLE", b"ray::Dashboard")):
            return 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KIB
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass  # the process ended between the listing and the read
    return 0


def measure(backend: str, steps: int, skip: int, pretrain: str, overrides: list[str]) -> dict[str, float]:
    """Run the job with actor_train on `backend`; its mean train and step seconds, worker processes and peaks (GiB)."""
    strategy, block = BACKENDS[backend]
    swap = [
        f"actor_train.strategy_args.strategy_name={strategy}",
        f"actor_train.strategy_args.strategy_config=${{{block}}}",
    ]
    with tempfile.TemporaryDirectory() as output_dir, WorkerPeaks() as peaks:
        rows = rlvr_step_breakdown.run(steps, [*swap, *overrides], output_dir, pretrain)[skip:]
    ray.shutdown()  # the next backend in a Ray of its own: no worker process (and its peak) carries over
    if not rows or not peaks.peaks:
        raise SystemExit(f"{backend}: no steps after --skip {skip}, or no worker process seen; raise --steps")
    return {
        "train_s": statistics.mean(row[TRAIN_PHASE] for row in rows),
        "step_s": statistics.mean(row["time/step_s"] for row in rows),
        "largest_gib": max(peaks.peaks.values()) / KIB**3,
        "sum_gib": sum(peaks.peaks.values()) / KIB**3,
        "processes": len(peaks.peaks),
    }


def table(results: dict[str, dict[str, float]]) -> str:
    """The backends' numbers as a markdown table."""
    lines = [
        "| actor_train | train phase s | step s | largest worker peak GiB | worker processes | their peaks' sum GiB |",
        "|---|---|---|---|---|---|",
    ]
    for backend, r in results.items():
        strategy, block = BACKENDS[backend]
        lines.append(
            f"| `{strategy}` `${{{block}}}` | {r['train_s']:.3f} | {r['step_s']:.3f} | {r['largest_gib']:.2f} "
            f"| {r['processes']} | {r['sum_gib']:.2f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The options; anything else on the command line is a Hydra override of every run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", choices=sorted(BLOCK_OF_MODEL), default="small", help="small: 0.3M, medium: 23.7M params"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the averages")
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=["zero3", "fsdp2"])
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite this model's table in {DOC.name}")
    return parser


def main() -> None:
    """Parse arguments, run every backend one after another, print the table (and write it)."""
    args, overrides = build_parser().parse_known_args()
    if args.write_docs and overrides:
        raise SystemExit("--write-docs writes the tables of the default job only; drop the Hydra overrides")
    pretrain = rlvr_step_breakdown.MODELS[args.model][0]
    load = os.getloadavg()[0]
    results = {name: measure(name, args.steps, args.skip, pretrain, overrides) for name in args.backends}
    loads = f"{load:.1f} / {os.getloadavg()[0]:.1f}"
    result = f"{table(results)}\n\n1-minute load average before / after the runs: {loads}."
    command = doc_tables.command_line(__file__, sys.argv[1:])
    print(f"{doc_tables.provenance(command, PACKAGES)}\n\n{result}")
    if args.write_docs:
        doc_tables.write_block(DOC, BLOCK_OF_MODEL[args.model], command, result, PACKAGES)


if __name__ == "__main__":
    main()
