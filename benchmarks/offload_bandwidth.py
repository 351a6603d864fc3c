"""Bandwidth of offloading DeepSpeed engine states, next to the host's own copy and disk bandwidth.

Builds a one-rank DeepSpeed engine over an MLP of about --params-millions parameters, trains one step so that every
state exists, then times full offload + reload cycles to host memory and to --nvme-dir, and reference copies of the
same number of bytes measured in the same run: device <-> host copies into preallocated buffers (pinned on
accelerators, plain memcpy on CPU-only machines), and a sequential write + read of a file in --nvme-dir. Prints a
markdown table (docs/offload.md shows one and the command that made it); `--write-docs` rewrites the table of this
run's allocator there (THP_MEM_ALLOC_ENABLE=1: huge pages; unset or 0: the default allocator).

`--zero-infinity` measures instead what ZeRO-Infinity costs a training step: the same layers at ZeRO-3 with the
parameters and Adam's states offloaded by DeepSpeed itself, to host memory (`device: cpu`) or swapped to files in
a fresh folder under --nvme-dir (`device: nvme`, DeepSpeed's async I/O op), timed step for step in interleaved
rounds, with the bytes each step reads from and writes to disk (/proc/self/io) and the size of the swap folder.

    source scripts/cpu_env.sh && .venv/bin/python benchmarks/offload_bandwidth.py --params-millions 64
    source scripts/cpu_env.sh && .venv/bin/python benchmarks/offload_bandwidth.py --params-millions 64 --zero-infinity
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402

GB = 1e9
DOC = REPO_ROOT / "docs" / "offload.md"
PACKAGES = ("torch", "deepspeed")
# torch reads THP_MEM_ALLOC_ENABLE at start-up: huge pages for its CPU allocator (scripts/cpu_env.sh sets it).
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
ALLOCATOR_BLOCKS = ("offload_bandwidth-default-allocator", "offload_bandwidth-huge-pages")
INFINITY_BLOCK = "offload_bandwidth-zero-infinity"
BLOCKS = (*ALLOCATOR_BLOCKS, INFINITY_BLOCK)
HIDDEN = 2048  # width of the benchmark's square linear layers


def block() -> str:
    """The block of docs/offload.md for this process's allocator setting."""
    return ALLOCATOR_BLOCKS[os.environ.get(HUGE_PAGES, "0") not in ("", "0")]


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=64.0, help="model size")
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="directory of the disk offload")
    parser.add_argument("--repeats", type=int, default=5, help="cycles per measurement; the best one counts")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's core budget)")
    parser.add_argument(
        "--zero-infinity",
        action="store_true",
        help="time ZeRO-3 training steps with DeepSpeed's offload to cpu vs nvme",
    )
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite this run's table in {DOC.name}")
    return parser


def init_single_rank() -> None:
    """A one-process DeepSpeed world."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def build_engine(params_millions: float, stage: int) -> Any:
    """A patched bf16 AdamW engine at ZeRO `stage` over bias-free HIDDEN-wide linear layers, after one step."""

    from roll.third_party.deepspeed.offload_states_patch import patch_engine

    return patch_engine(trained_engine(params_millions, {"stage": stage}))


def trained_engine(params_millions: float, zero: dict[str, Any]) -> Any:
    """A bf16 AdamW engine with ZeRO block `zero` over bias-free HIDDEN-wide linear layers, after one step."""
    import deepspeed

    layers = max(1, round(params_millions * 1e6 / HIDDEN**2))
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    train_step(engine)
    return engine


def train_step(engine: Any) -> None:
    """Forward, backward and optimizer step on a random batch of 2 rows."""
    from deepspeed.accelerator import get_accelerator

    batch = torch.randn(2, HIDDEN, dtype=torch.bfloat16, device=get_accelerator().current_device_name())
    engine.backward(engine(batch).float().pow(2).mean())
    engine.step()


def infinity_zero_block(device: str, swap_dir: str) -> dict[str, Any]:
    """ZeRO-3 with parameters and Adam's states offloaded by DeepSpeed to `device` (cpu or nvme, into `swap_dir`).

    Sub-groups and prefetch of one layer keep DeepSpeed's swap buffers near the layer size: its defaults (1e8
    elements a buffer, 1e9 a sub-group) pin gigabytes of host memory. Both devices get the same block, so the
    step times differ by where the states live only.
    """
    layer = HIDDEN * HIDDEN
    param: dict[str, Any] = {"device": device}
    optimizer: dict[str, Any] = {"device": device}
    if device == "nvme":
        param |= {"nvme_path": swap_dir, "buffer_count": 5, "buffer_size": layer}
        optimizer |= {"nvme_path": swap_dir, "buffer_count": 4}
    return {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": layer,
        "sub_group_size": layer,
        "offload_param": param,
        "offload_optimizer": optimizer,
    }


def disk_io() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (/proc/self/io; DeepSpeed's O_DIRECT swaps count)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def folder_bytes(path: Path) -> int:
    """Bytes of the files under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass(frozen=True)
class StepCost:
    """One training step: wall seconds, CPU seconds of every thread of the process, bytes read and written."""

    seconds: float
    cpu_seconds: float
    read: int
    written: int


def measured_step(engine: Any) -> StepCost:
    """Run one training step of `engine` and return what it cost."""
    read, written = disk_io()
    cpu = time.process_time()
    seconds = timed(lambda: train_step(engine))
    cpu_seconds = time.process_time() - cpu
    after = disk_io()
    return StepCost(seconds, cpu_seconds, after[0] - read, after[1] - written)


def zero_infinity_lines(args: argparse.Namespace) -> list[str]:
    """Time training steps with DeepSpeed's offload to cpu and to nvme in interleaved rounds and return the table.

    The fastest step of each counts, as in the bandwidth table; the median and the CPU time (which other processes'
    load barely changes) show how much of a difference is the machine's load.
    """
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise SystemExit("--zero-infinity needs DeepSpeed's async_io op: apt-get install libaio-dev (setup_env.sh)")
    devices = {"cpu": "cpu (host memory)", "nvme": "**nvme (ZeRO-Infinity)**"}
    with tempfile.TemporaryDirectory(prefix="zero_infinity_", dir=args.nvme_dir) as swap_dir:
        engines = {
            device: trained_engine(args.params_millions, infinity_zero_block(device, swap_dir)) for device in devices
        }
        steps: dict[str, list[StepCost]] = {device: [] for device in devices}
        for _ in range(args.repeats):
            for device, engine in engines.items():
                steps[device].append(measured_step(engine))
        swapped = folder_bytes(Path(swap_dir))
        params = sum(p.ds_numel for p in engines["cpu"].module.parameters())
        for engine in engines.values():
            engine.destroy()
    fastest = {device: min(costs, key=lambda cost: cost.seconds) for device, costs in steps.items()}
    lines = [
        f"ZeRO-3, {params / 1e6:.1f}M parameters (bf16, AdamW), parameters and Adam states offloaded by DeepSpeed, "
        f"{args.threads} thread(s), swap folder under {args.nvme_dir}, {HUGE_PAGES}={os.environ.get(HUGE_PAGES, '')}, "
        f"{args.repeats} interleaved steps each (disk bytes of the fastest):\n",
        "| offload_param + offload_optimizer | fastest step s | vs cpu | median step s | CPU s/step "
        "| disk read GB/step | disk write GB/step | swap GB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for device, name in devices.items():
        best, costs = fastest[device], steps[device]
        median = float(np.median([cost.seconds for cost in costs]))
        cpu_seconds = float(np.median([cost.cpu_seconds for cost in costs]))
        files = swapped if device == "nvme" else 0
        lines.append(
            f"| {name} | {best.seconds:.2f} | {best.seconds / fastest['cpu'].seconds:.2f}x | {median:.2f} "
            f"| {cpu_seconds:.2f} | {best.read / GB:.2f} | {best.written / GB:.2f} | {files / GB:.2f} |"
        )
    return lines


def timed(work: Callable[[], object]) -> float:
    """Seconds `work` takes, with the device synchronized before and after."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()
    start = time.perf_counter()
    work()
    get_accelerator().synchronize()
    return time.perf_counter() - start


def references(nbytes: int, directory: str) -> dict[str, tuple[Callable[[], object], int]]:
    """Reference work on `nbytes`, by name, with the bytes one run moves: device -> host -> device copies into
    preallocated buffers (pinned on accelerators), a copy into fresh memory, glibc memcpy (CPU-only machines) and a
    sequential write + read of a file in `directory` (through the page cache, as the offload does)."""
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    accelerated = get_accelerator().device_name() != "cpu"
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=accelerated)
    on_disk, back = memoryview(host.numpy()), memoryview(torch.zeros(nbytes, dtype=torch.uint8).numpy())

    def write_and_read() -> None:
        with tempfile.TemporaryFile(dir=directory, buffering=0) as file:
            file.write(on_disk)
            file.seek(0)
            file.readinto(back)

    work = {
        "copy": (lambda: (host.copy_(source), source.copy_(host)), 2 * nbytes),
        "fresh": (lambda: torch.empty_like(source).copy_(source), nbytes),
        "disk": (write_and_read, 2 * nbytes),
    }
    if not accelerated:
        work["memcpy"] = (lambda: np.copyto(host.numpy(), source.numpy()), nbytes)
    return work


def main() -> None:
    """Measure in interleaved rounds (the best round counts, so that load from other processes hits every
    measurement alike) and print the table."""
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    init_single_rank()
    if args.zero_infinity:
        report(args, INFINITY_BLOCK, zero_infinity_lines(args))
        return
    from deepspeed.accelerator import get_accelerator

    engine = build_engine(args.params_millions, args.stage)
    nbytes = sum(engine.offload_states().moved_bytes.values())
    engine.reload_states()
    work = references(nbytes, args.nvme_dir)
    rates: dict[str, float] = {}
    cycles: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeats):
        for device in ("cpu", "nvme"):
            offload = engine.offload_states(device=device, nvme_dir=args.nvme_dir)
            reload = engine.reload_states()
            if device not in cycles or offload.seconds + reload.seconds < sum(cycles[device]):
                cycles[device] = (offload.seconds, reload.seconds)
        for name, (run, moved) in work.items():
            rates[name] = max(rates.get(name, 0.0), moved / timed(run) / GB)
    reference = rates.get("memcpy", rates["copy"])
    lines = [
        f"ZeRO-{args.stage}, {args.params_millions:g}M parameters (bf16, AdamW), {nbytes / GB:.2f} GB of states, "
        f"{get_accelerator().device_name()}, {args.threads} thread(s), disk: {args.nvme_dir}, "
        f"{HUGE_PAGES}={os.environ.get(HUGE_PAGES, '')}, "
        f"best of {args.repeats} interleaved rounds:\n",
        "| measurement | offload GB/s | reload GB/s | round trip GB/s | of reference |",
        "|---|---:|---:|---:|---:|",
    ]
    if "memcpy" in rates:
        lines.append(reference_row("reference: memcpy (glibc), preallocated destination", reference, reference))
    lines += [
        reference_row("device -> host -> device copy_, preallocated buffers", rates["copy"], reference),
        reference_row("copy into freshly allocated memory", rates["fresh"], reference),
        offload_row("**offload_states + reload_states, host**", nbytes, cycles["cpu"], reference),
        reference_row("reference: sequential write + read in the disk directory", rates["disk"], rates["disk"]),
        offload_row("**offload_states + reload_states, nvme**", nbytes, cycles["nvme"], rates["disk"]),
    ]
    report(args, block(), lines)


def report(args: argparse.Namespace, name: str, lines: list[str]) -> None:
    """Print the table with its command and machine; with --write-docs also put it in block `name` of the doc."""
    command = doc_tables.command_line(__file__, sys.argv[1:], env=(HUGE_PAGES,))
    print(f"{doc_tables.provenance(command, PACKAGES)}\n\n" + "\n".join(lines))
    if args.write_docs:
        doc_tables.write_block(DOC, name, command, "\n".join(lines), PACKAGES)


def reference_row(name: str, rate: float, reference: float) -> str:
    """A markdown table row of a reference measurement."""
    return f"| {name} |  |  | {rate:.2f} | {rate / reference:.0%} |"


def offload_row(name: str, nbytes: int, seconds: tuple[float, float], reference: float) -> str:
    """A markdown table row of an offload and a reload of `nbytes` that took `seconds`."""
    offload, reload = nbytes / seconds[0] / GB, nbytes / seconds[1] / GB
    round_trip = 2 * nbytes / sum(seconds) / GB
    return f"| {name} | {offload:.2f} | {reload:.2f} | {round_trip:.2f} | {round_trip / reference:.0%} |"


if __name__ == "__main__":
    main()
