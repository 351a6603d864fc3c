"""Host memory of an RLVR run at real model sizes, process by process, against the dry run's node estimate.

    python benchmarks/scale_memory.py [--sizes 24m 0.1b 0.36b 0.5b] [--steps 2] [--write-docs] [OVERRIDE ...]

For each size it runs `roll-rlvr` (by default the 0.5B-class CPU recipe, `--config-name` to change it) on a
`tiny://` model of that shape as a user would, in its own process, and samples every process of the run (the
driver, Ray's own, each worker) five times a second: each one's proportional set size (PSS: shared pages split
between the processes sharing them, so the sum is what the run costs), by role, rank and the method a busy worker
runs (Ray titles it `ray::ActorWorker.train_step`), and the node's used memory over what it was before the run.
Beside it, `node_estimate` of the same config: what the dry run prints and what refuses a run that will not fit.
OVERRIDEs go to every run (e.g. `actor_train.strategy_args.strategy_config='${deepspeed_zero3}'`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from benchmarks import doc_tables  # noqa: E402
from roll.configs.hydra_defaults import register_schema_defaults  # noqa: E402
from roll.configs.loader import load_pipeline_config, yaml_names  # noqa: E402
from roll.pipeline.base.dry_run.node_estimate import estimate_nodes  # noqa: E402
from roll.pipeline.rlvr.rlvr_config import RLVRConfig  # noqa: E402

GiB = 2**30
DOC = REPO_ROOT / "docs" / "memory_estimate.md"
BLOCKS = ("scale_memory",)
QWEN25_05B = "hidden_size=896&num_layers=24&num_heads=14&num_kv_heads=2&intermediate_size=4864&tie_word_embeddings=true"
SIZES = {
    "24m": "tiny://qwen2?hidden_size=512&num_layers=8&num_heads=8&num_kv_heads=2&intermediate_size=1408",
    "0.1b": "tiny://qwen2?hidden_size=768&num_layers=12&num_heads=12&num_kv_heads=2&intermediate_size=2688",
    "0.36b": f"tiny://qwen2?{QWEN25_05B}",  # Qwen2.5-0.5B's decoder with the character vocabulary
    "0.5b": f"tiny://qwen2?{QWEN25_05B}&vocab_size=151936&max_position_embeddings=32768",  # its full shape
}
CONFIG_DIR = REPO_ROOT / "examples" / "config"
CONFIG_NAME = "rlvr_qwen2.5_0.5b_cpu"
SAMPLE_S = 0.2


@dataclass
class Sampled:
    """Peaks seen while a run was sampled: per process (role, rank), per (role, method), and of the node."""

    process_peak: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    method_peak: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    node_peak: int = 0
    run_peak: int = 0  # the largest sum of the run's own processes' PSS


def _pss(pid: int) -> int:
    """The process's proportional set size in bytes (0 once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _worker_pids(pid_dir: Path) -> dict[int, str]:
    """`role/rank` of each worker that has written its pid file (roll's workers do with ROLL_PID_DIR set); roles that
    share a process (share_worker_processes) are joined by `+`."""
    labels: dict[int, list[str]] = {}
    for path in sorted(pid_dir.glob("*.pid")):
        role, _, rank = path.stem.rpartition("-")
        try:
            labels.setdefault(int(path.read_text()), []).append(f"{role}/{rank}")
        except ValueError:
            continue  # being written
    return {pid: " + ".join(names) for pid, names in labels.items()}


def sample(run: subprocess.Popen, baseline_used: int, pid_dir: Path) -> Sampled:
    """Sample `run`'s process tree until it exits."""
    sampled = Sampled()
    root = psutil.Process(run.pid)
    while run.poll() is None:
        try:
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        labels = {run.pid: "driver", **_worker_pids(pid_dir)}
        total, others = 0, defaultdict(int)  # this tick's PSS of the driver and of Ray's processes together
        for process in processes:
            pss = _pss(process.pid)
            total += pss
            label = labels.get(process.pid, "Ray's processes and helpers")
            if label in labels.values() and label != "driver":
                sampled.process_peak[label] = max(sampled.process_peak[label], pss)
            else:
                others[label] += pss
            try:
                title = process.cmdline()[0]
            except (psutil.Error, IndexError):
                continue
            method = title.partition(".")[2] if title.startswith("ray::") else ""
            if method and label in labels.values():
                # A shared process runs every call through WorkerHost.call: its roles together name it.
                key = ("+".join(member.split("/")[0] for member in label.split(" + ")), method)
                sampled.method_peak[key] = max(sampled.method_peak[key], pss)
        for label, pss in others.items():
            sampled.process_peak[label] = max(sampled.process_peak[label], pss)
        memory = psutil.virtual_memory()
        sampled.run_peak = max(sampled.run_peak, total)
        sampled.node_peak = max(sampled.node_peak, memory.total - memory.available - baseline_used)
        time.sleep(SAMPLE_S)
    return sampled


def run_size(size: str, steps: int, overrides: list[str], output_dir: Path) -> tuple[Sampled, float, float]:
    """Run the recipe at `size` for `steps` steps; return what was sampled, the wall time and the step time."""
    command = [
        sys.executable,
        str(REPO_ROOT / "examples" / "start_rlvr_pipeline.py"),
        f"--config-name={CONFIG_NAME}",
        f"pretrain='{SIZES[size]}'",
        f"max_steps={steps}",
        f"output_dir={output_dir}",
        f"run_dir={output_dir / 'run'}",
        *overrides,
    ]
    memory = psutil.virtual_memory()
    baseline = memory.total - memory.available
    started = time.monotonic()
    pid_dir = output_dir / "pids"
    pid_dir.mkdir()
    env = {**os.environ, "ROLL_PID_DIR": str(pid_dir)}
    with tempfile.TemporaryFile("w+") as stderr:
        run = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        holder: list[Sampled] = []
        sampler = threading.Thread(target=lambda: holder.append(sample(run, baseline, pid_dir)))
        sampler.start()
        run.wait()
        sampler.join()
        stderr.seek(0)
        tail = stderr.read()[-3000:]
    if run.returncode != 0:
        raise SystemExit(f"{size}: the run failed (exit {run.returncode}):\n{tail}")
    rows = [json.loads(line) for line in (output_dir / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [row["time/step_s"] for row in rows if "time/step_s" in row]
    # The first step warms up (allocations, first-call overheads): the mean of the others, when there are some.
    return holder[0], time.monotonic() - started, sum(steps[1:] or steps) / len(steps[1:] or steps)


def estimated(size: str, overrides: list[str]) -> tuple[int, dict[str, int], str, str]:
    """The dry run's node estimate of the same run: total, each worker process's peak (by its ranks' `role/rank`s,
    joined by ` + ` where roles share a process, as `_worker_pids` labels it), its largest term, the actor's dtype
    (the recipe's `auto` resolved on this machine)."""
    register_schema_defaults("rlvr", RLVRConfig)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(CONFIG_NAME, overrides=[f"pretrain='{SIZES[size]}'", *overrides])
    config = load_pipeline_config(cfg, RLVRConfig, yaml_names([CONFIG_DIR]))
    node = estimate_nodes(config)[0]
    return node.total, node.process_peaks(), node.largest_term, config.actor_train.model_args.dtype


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options; unknown arguments are the runs' Hydra overrides."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(doc_tables.WRITE_DOCS, action="store_true", dest="write_docs")
    return parser


def main() -> None:
    args, overrides = build_parser().parse_known_args()
    rows, details = [], []
    for size in args.sizes:
        total, per_process, largest, dtype = estimated(size, overrides)
        with tempfile.TemporaryDirectory() as output_dir:
            sampled, seconds, step_s = run_size(size, args.steps, overrides, Path(output_dir))
        ratio = sampled.node_peak / total
        rows.append(
            f"| {size} | {dtype} | {sampled.node_peak / GiB:.2f} | {sampled.run_peak / GiB:.2f} | {total / GiB:.2f} | "
            f"{ratio:.2f} | {largest} | {step_s:.1f} | {seconds:.0f} |"
        )
        details.append(f"\n**{size}** (`{SIZES[size]}`): peak PSS per process, measured / estimated (GiB)\n")
        details.append("| process | measured | estimated |\n|---|---:|---:|")
        for label in sorted(set(sampled.process_peak) | set(per_process)):
            measured = sampled.process_peak.get(label, 0)
            guess = per_process.get(label)
            guess_text = f"{guess / GiB:.2f}" if guess is not None else "(in 'driver and Ray')"
            details.append(f"| {label} | {measured / GiB:.2f} | {guess_text} |")
        busiest = sorted(sampled.method_peak.items(), key=lambda item: -item[1])[:8]
        details.append(
            "\nLargest PSS by role and method: " + ", ".join(f"{r}.{m} {b / GiB:.2f}" for (r, m), b in busiest)
        )
        print(rows[-1], flush=True)
    header = (
        "| size | dtype | node peak (GiB, used memory over before) | sum of the run's PSS | estimate "
        "| measured / estimate | largest term | s/step | run s |\n|---|---|---:|---:|---:|---:|---|---:|---:|"
    )
    text = "\n".join([header, *rows, *details])
    print(text)
    if args.write_docs:
        doc_tables.write_block(DOC, BLOCKS[0], doc_tables.command_line(__file__, sys.argv[1:]), text)


if __name__ == "__main__":
    main()
