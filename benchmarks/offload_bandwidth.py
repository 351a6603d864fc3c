"""Bandwidth of offloading DeepSpeed engine states, next to the host's own copy and disk bandwidth.

Builds a one-rank DeepSpeed engine over an MLP of about --params-millions parameters, trains one step so that every
state exists, then times full offload + reload cycles to host memory and to --nvme-dir, and reference copies of the
same number of bytes measured in the same run: device <-> host copies into preallocated buffers (pinned on
accelerators, plain memcpy on CPU-only machines), and a sequential write + read of a file in --nvme-dir. Prints a
markdown table (docs/offload.md shows one and the command that made it); `--write-docs` rewrites the table of this
run's allocator there (THP_MEM_ALLOC_ENABLE=1: huge pages; unset or 0: the default allocator).

    source scripts/cpu_env.sh && .venv/bin/python benchmarks/offload_bandwidth.py --params-millions 64
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
BLOCKS = ("offload_bandwidth-default-allocator", "offload_bandwidth-huge-pages")


def block() -> str:
    """The block of docs/offload.md for this process's allocator setting."""
    return BLOCKS[os.environ.get(HUGE_PAGES, "0") not in ("", "0")]


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=64.0, help="model size")
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="directory of the disk offload")
    parser.add_argument("--repeats", type=int, default=5, help="cycles per measurement; the best one counts")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's core budget)")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite this allocator's table in {DOC.name}")
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
    """A patched bf16 AdamW engine over bias-free 2048-wide linear layers, after one training step."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from roll.third_party.deepspeed.offload_states_patch import patch_engine

    hidden = 2048
    layers = max(1, round(params_millions * 1e6 / hidden**2))
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    batch = torch.randn(2, hidden, dtype=torch.bfloat16, device=get_accelerator().current_device_name())
    engine.backward(engine(batch).float().pow(2).mean())
    engine.step()
    return patch_engine(engine)


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
    command = doc_tables.command_line(__file__, sys.argv[1:], env=(HUGE_PAGES,))
    print(f"{doc_tables.provenance(command, PACKAGES)}\n\n" + "\n".join(lines))
    if args.write_docs:
        doc_tables.write_block(DOC, block(), command, "\n".join(lines), PACKAGES)


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
