"""Per-rank bytes of ZeRO model states at stages 0-3, beside the ZeRO paper's formulas.

    python benchmarks/zero_memory.py [--hidden 256 --layers 4 --intermediate 1024 --stages 0 1 2 3]

For each stage it starts a 2-rank `deepspeed_train` role in bf16 with AdamW (the examples/config
blocks; stage 1 is the zero2 block at stage 1), runs one optimizer step of two micro-batches and
counts, on every rank, the bytes of every tensor the DeepSpeed engine and its optimizer hold:
16-bit parameters, gradients, fp32 master weights and Adam moments, each storage once. It prints a
markdown table with the paper's totals for mixed-precision Adam (Rajbhandari et al., 2020, fig. 1):
16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N bytes per rank, and each rank's peak RSS.
See docs/zero_memory.md for the numbers and why they differ where they do; `--write-docs` rewrites its tables
of this model shape (blocks named by Ψ), and refuses options other than the shape, whose tables are not blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import gc
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402
from roll.configs.worker_config import (  # noqa: E402
    ModelArguments,
    StrategyArguments,
    TrainingArguments,
    WorkerConfig,
)
from roll.distributed.executor.worker import Worker  # noqa: E402
from roll.distributed.scheduler.decorator import Dispatch, register  # noqa: E402
from roll.distributed.strategy.registry import strategy_class  # noqa: E402
from roll.models.model_providers import load_model  # noqa: E402
from roll.pipeline.base.dry_run.model_states import zero_model_states  # noqa: E402

WORKER = "benchmarks.zero_memory.MemoryWorker"
DOC = REPO_ROOT / "docs" / "zero_memory.md"
PACKAGES = ("torch", "deepspeed")
SHAPE_OPTIONS = ("hidden", "layers", "intermediate", "heads", "kv_heads")
# The model sizes docs/zero_memory.md has tables of: the default shape and `--hidden 768 --layers 6
# --intermediate 3072 --heads 12 --kv-heads 4`.
DOC_PSI = (3_981_568, 52_057_344)
CONFIG_DIR = REPO_ROOT / "examples" / "config"
WORLD_SIZE = 2
MiB = 2**20

CATEGORIES = ("params", "grads", "master", "moments", "buckets", "other")
# A storage reached under several names goes to the first of these categories among them: a
# parameter's storage is also in the optimizer's 16-bit groups, a master weight is also the inner
# optimizer's param, a gradient may also be listed in a communication bucket.
_PRIORITY = {"params": 0, "master": 1, "moments": 2, "grads": 3, "buckets": 4, "other": 5}
# Containers deeper than this inside the engine hold no model state (config objects, timers).
_MAX_DEPTH = 8


def classify(path: str) -> str:
    """The model-state category of a tensor from the attribute path it was reached by."""
    lowered = path.lower()
    if "ipg" in lowered or "bucket" in lowered:
        return "buckets"
    if "exp_avg" in lowered:
        return "moments"
    if "grad" in lowered and "grad_norm" not in lowered:
        return "grads"
    if "fp32" in lowered:
        return "master"
    if lowered.startswith("model.") or any(k in lowered for k in ("bit16", "fp16", "bf16", "ds_tensor", "lp_param")):
        return "params"
    return "other"


class StorageCensus:
    """Bytes of distinct tensor storages, each attributed to one category."""

    def __init__(self) -> None:
        self._storages: dict[tuple[str, int], tuple[int, str, str]] = {}

    def add(self, path: str, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        key = (str(tensor.device), storage.data_ptr())
        category = classify(path)
        known = self._storages.get(key)
        if known is None or _PRIORITY[category] < _PRIORITY[known[1]]:
            self._storages[key] = (storage.nbytes(), category, path)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return (str(tensor.device), tensor.untyped_storage().data_ptr()) in self._storages

    def totals(self) -> dict[str, int]:
        sums = dict.fromkeys(CATEGORIES, 0)
        for nbytes, category, _ in self._storages.values():
            sums[category] += nbytes
        return sums

    def largest(self, category: str, count: int = 4) -> list[tuple[str, int]]:
        """The biggest storages of a category, by the path they were attributed under."""
        found = sorted((n, p) for n, c, p in self._storages.values() if c == category)
        return [(p, n) for n, p in reversed(found[-count:])]


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            label = f"<{type(key).__name__}>" if isinstance(key, torch.Tensor) else repr(key)
            yield f"[{label}]", value
    elif isinstance(obj, list | tuple | set | frozenset):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
    elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        for name, value in vars(obj).items():
            yield f".{name}", value


def walk(census: StorageCensus, path: str, obj: Any, seen: set[tuple[int, str]], depth: int = 0) -> None:
    """Add every tensor reachable from `obj` through containers and DeepSpeed/optimizer objects."""
    if isinstance(obj, torch.Tensor):
        census.add(path, obj)
        # Leaves carry their gradient, and ZeRO-3 parameters their partition, as attributes.
        for attr in ("grad", "ds_tensor", "grad_accum"):
            extra = getattr(obj, attr, None) if obj.is_leaf or attr != "grad" else None
            if isinstance(extra, torch.Tensor):
                walk(census, f"{path}.{attr}", extra, seen, depth + 1)
        return
    # A container is walked again under a name of another category: optimizers share lists (the
    # inner optimizer's param group *is* the wrapper's fp32 group), and the first name met may be generic.
    # Modules are not entered: weights are reached by name, and the module graph holds no other state.
    key = (id(obj), classify(path))
    if depth > _MAX_DEPTH or key in seen or isinstance(obj, torch.nn.Module):
        return
    seen.add(key)
    for suffix, child in list(_children(obj)):
        walk(census, path + suffix, child, seen, depth + 1)


def engine_census(engine: Any) -> StorageCensus:
    """Every tensor storage held by the model's parameters and by the engine's optimizer and scheduler."""
    census = StorageCensus()
    seen: set[tuple[int, str]] = set()
    for name, param in engine.module.named_parameters():
        walk(census, f"model.{name}", param, seen)
    for name, value in vars(engine).items():
        walk(census, f"engine.{name}", value, seen)
    return census


def unreached_tensors(census: StorageCensus) -> dict[tuple[str, int], tuple[int, str]]:
    """Live Python tensors of this process whose storage the census did not reach (a check on the walk).

    Keyed by storage; each with its bytes and a description. Tensors that exist only inside C++
    (autograd's saved activations) have no Python object and are not seen here.
    """
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and obj not in census:
            storage = obj.untyped_storage()
            found[(str(obj.device), storage.data_ptr())] = (storage.nbytes(), f"{obj.dtype} {tuple(obj.shape)}")
    return found


def peak_rss() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """This process's resident set size now, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trimmed_rss() -> int:
    """Resident set size after glibc hands freed heap pages back to the OS (malloc_trim), in bytes."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the plain RSS
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return current_rss()


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten())


class MemoryWorker(Worker):
    """A deepspeed_train rank that steps once and reports what its engine holds."""

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> None:
        self.rss = {"before_model": current_rss()}
        self.strategy = strategy_class("deepspeed_train")(self)
        self.strategy.initialize(lambda: load_model(self.worker_config.model_args, trainable=True))
        self.rss["after_init"] = current_rss()
        self.rss["peak_by_init"] = peak_rss()

    @register(Dispatch.ONE_TO_ALL)
    def measure(self, seq_len: int, seed: int) -> dict[str, Any]:
        """One optimizer step of random tokens; censuses after the first backward, the last one, and the step."""
        engine = self.strategy.engine
        args = self.worker_config.training_args
        vocab = engine.module.config.vocab_size
        generator = torch.Generator().manual_seed(seed + self.rank)
        engine.train()
        censuses: dict[str, StorageCensus] = {}
        steps = args.gradient_accumulation_steps
        for micro in range(steps):
            input_ids = torch.randint(4, vocab, (args.per_device_train_batch_size, seq_len), generator=generator)
            output = engine(input_ids=input_ids, use_cache=False)
            engine.backward(lm_loss(output.logits, input_ids))
            del output
            if micro == 0 and steps > 1:
                censuses["accumulating"] = engine_census(engine)  # gradients held between micro-batches
            if micro == steps - 1:
                censuses["boundary"] = engine_census(engine)  # gradients as the optimizer step gets them
            engine.step()
        censuses["after_step"] = engine_census(engine)
        self.rss["after_step"] = current_rss()
        self.rss["after_step_trimmed"] = trimmed_rss()
        self.rss["peak"] = peak_rss()
        psi = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
        return {
            "rank": self.rank,
            "psi": psi,
            "optimizer": type(engine.optimizer).__name__,
            "totals": {k: c.totals() for k, c in censuses.items()},
            "largest": {k: {cat: c.largest(cat) for cat in CATEGORIES} for k, c in censuses.items()},
            "unreached_after_step": sorted(unreached_tensors(censuses["after_step"]).values(), reverse=True),
            "rss": self.rss,
        }

    @register(Dispatch.ONE_TO_ALL)
    def shutdown_strategy(self) -> None:
        self.strategy.shutdown()


def zero_block(stage: int, bucket_elements: int, persistence_threshold: int) -> dict[str, Any]:
    """The examples/config block of a stage (stage 1: zero2 at stage 1), buckets resized unless 0."""
    name = {0: "deepspeed_zero", 1: "deepspeed_zero2", 2: "deepspeed_zero2", 3: "deepspeed_zero3"}[stage]
    block = copy.deepcopy(yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())[name])
    zero = block["zero_optimization"]
    zero["stage"] = stage
    # The examples size buckets for billion-parameter models (5e7-5e8 elements); at a few million
    # parameters such a bucket alone would outweigh the model states being measured.
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        if key in zero and bucket_elements:
            zero[key] = bucket_elements
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    return block


def run_stage(manager: Any, model_path: str, stage: int, options: argparse.Namespace) -> list[dict[str, Any]]:
    """Start a 2-rank bf16 deepspeed_train role at `stage`, step once, return every rank's report."""
    from roll.distributed.executor.cluster import Cluster

    config = WorkerConfig(
        worker_cls=WORKER,
        device_mapping=f"0-{WORLD_SIZE - 1}",
        model_args=ModelArguments(model_name_or_path=model_path, dtype="bf16"),
        strategy_args=StrategyArguments(
            strategy_name="deepspeed_train",
            strategy_config=zero_block(stage, options.bucket_elements, options.persistence_threshold),
        ),
        training_args=TrainingArguments(
            learning_rate=1e-4,
            per_device_train_batch_size=options.micro_batch,
            gradient_accumulation_steps=options.accumulation,
        ),
    )
    config.resolve("actor_train", manager.total_devices)
    cluster = Cluster(WORKER, config, manager)
    try:
        cluster.initialize()
        reports = cluster.measure(options.seq_len, options.seed)
        cluster.shutdown_strategy()
    finally:
        cluster.shutdown()
    return reports


def model_states(report: dict[str, Any]) -> dict[str, int]:
    """Per-category bytes a rank needs: gradients at their largest over the step, the rest after it."""
    totals = report["totals"]
    after = totals["after_step"]
    grads = max(t["grads"] for t in totals.values())
    return {
        "params": after["params"],
        "grads": grads,
        "master": after["master"],
        "moments": after["moments"],
        "buckets": max(t["buckets"] for t in totals.values()),
        "other": max(t["other"] for t in totals.values()),
    }


def _rows(results: dict[int, list[dict[str, Any]]]) -> Iterator[tuple[int, dict[str, Any]]]:
    for stage, reports in results.items():
        for report in sorted(reports, key=lambda r: r["rank"]):
            yield stage, report


def states_table(results: dict[int, list[dict[str, Any]]]) -> str:
    """One row per stage and rank: measured MiB per category, their total, the formula's total, the ratio."""
    header = (
        "| stage | rank | params | grads (accumulating / at step) | fp32 master | Adam m+v | total | formula | "
        "measured / formula | buckets | other | not reached |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for stage, report in _rows(results):
        states = model_states(report)
        formula = sum(item.nbytes for item in zero_model_states(stage, report["psi"], WORLD_SIZE))
        total = sum(states[k] for k in ("params", "grads", "master", "moments"))
        totals = report["totals"]
        accumulating = totals.get("accumulating", totals["boundary"])["grads"]
        cells = [
            f"{states['params'] / MiB:.2f}",
            f"{accumulating / MiB:.2f} / {totals['boundary']['grads'] / MiB:.2f}",
            f"{states['master'] / MiB:.2f}",
            f"{states['moments'] / MiB:.2f}",
            f"**{total / MiB:.2f}**",
            f"{formula / MiB:.2f}",
            f"**{total / formula:.4f}**",
            f"{states['buckets'] / MiB:.2f}",
            f"{states['other'] / MiB:.2f}",
            f"{sum(n for n, _ in report['unreached_after_step']) / MiB:.2f}",
        ]
        lines.append(f"| {stage} | {report['rank']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rss_table(results: dict[int, list[dict[str, Any]]]) -> str:
    """One row per stage and rank: resident set size at each point and its peak, MiB."""
    header = (
        "| stage | rank | optimizer | before model | after engine init | after step | after step, heap trimmed | "
        "peak by end of init | peak |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for stage, report in _rows(results):
        rss = report["rss"]
        points = ("before_model", "after_init", "after_step", "after_step_trimmed", "peak_by_init", "peak")
        cells = [f"{rss[k] / MiB:.0f}" for k in points]
        lines.append(f"| {stage} | {report['rank']} | {report['optimizer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def formula_table(psi: int) -> str:
    """The paper's per-category bytes for this Ψ and N, in MiB."""
    lines = [
        f"Formula per rank for Ψ = {psi:,}, N = {WORLD_SIZE} (MiB): params / grads / fp32 master / Adam m+v = total"
    ]
    for stage, text in enumerate(("16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N")):
        parts = [item.nbytes for item in zero_model_states(stage, psi, WORLD_SIZE)]
        values = " / ".join(f"{v / MiB:.2f}" for v in parts)
        lines.append(f"  stage {stage} ({text}): {values} = {sum(parts) / MiB:.2f}")
    return "\n".join(lines)


def blocks(psi: int) -> tuple[str, str]:
    """The blocks of docs/zero_memory.md with the model-state and the RSS table of a Ψ-parameter model."""
    return f"zero_memory-states-psi{psi}", f"zero_memory-rss-psi{psi}"


BLOCKS = tuple(name for psi in DOC_PSI for name in blocks(psi))


def write_docs(results: dict[int, list[dict[str, Any]]], command: str) -> None:
    """Rewrite the model-state and RSS tables of this run's Ψ in docs/zero_memory.md."""
    psi = next(iter(results.values()))[0]["psi"]
    states, rss = blocks(psi)
    doc_tables.write_block(
        DOC, states, command, f"Ψ = {psi:,}, N = {WORLD_SIZE}, MiB (2²⁰ bytes):\n\n" + states_table(results), PACKAGES
    )
    doc_tables.write_block(DOC, rss, command, rss_table(results), PACKAGES)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--bucket-elements",
        type=int,
        default=2**18,
        help="reduce/allgather/stage-3 prefetch bucket size in elements; 0 keeps the examples' 5e7-5e8",
    )
    parser.add_argument(
        "--persistence-threshold",
        type=int,
        default=0,
        help="stage3_param_persistence_threshold: parameters this small stay whole on every rank (examples: 1e5)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--details", action="store_true", help="also print the largest storages of each category")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite this Ψ's tables in {DOC.name}")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    options = parser.parse_args(argv)
    if options.write_docs:
        changed = [
            f"--{k.replace('_', '-')}"
            for k, v in vars(options).items()
            if k not in (*SHAPE_OPTIONS, "write_docs", "details") and v != parser.get_default(k)
        ]
        if changed:
            parser.error(f"--write-docs writes the tables of the documented settings; drop {', '.join(changed)}")
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    # Ray workers import MemoryWorker as `benchmarks.zero_memory`; they inherit this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    from roll.distributed.scheduler.initialize import init_ray
    from roll.distributed.scheduler.resource_manager import ResourceManager
    from roll.models.tiny import TinyModelSpec, make_tiny_model
    from roll.platforms import get_platform

    spec = TinyModelSpec(
        hidden_size=options.hidden,
        num_layers=options.layers,
        intermediate_size=options.intermediate,
        num_heads=options.heads,
        num_kv_heads=options.kv_heads,
    )
    init_ray(None, "roll-benchmarks", 2 * WORLD_SIZE, "cpu")
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=WORLD_SIZE, cpus_per_device=1)
    results: dict[int, list[dict[str, Any]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="zero_memory_") as tmp:
            model_path = str(make_tiny_model(tmp, spec))
            for stage in options.stages:
                start = time.perf_counter()
                results[stage] = run_stage(manager, model_path, stage, options)
                optimizer = results[stage][0]["optimizer"]
                print(f"stage {stage}: {optimizer}, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    finally:
        manager.destroy()
        ray.shutdown()
    print(f"model: {spec}\n")
    print(formula_table(next(iter(results.values()))[0]["psi"]) + "\n")
    print("Model states per rank, MiB (2^20 bytes):\n")
    print(states_table(results) + "\n")
    print("Resident set size per rank, MiB:\n")
    print(rss_table(results))
    if options.write_docs:
        write_docs(results, doc_tables.command_line(__file__, argv if argv is not None else sys.argv[1:]))
    if options.details:
        for stage, reports in results.items():
            for report in reports:
                print(f"\nstage {stage} rank {report['rank']} ({report['optimizer']}), Ψ = {report['psi']}:")
                for moment, totals in report["totals"].items():
                    print(f"  {moment:12} bytes: " + ", ".join(f"{k} {v:,}" for k, v in totals.items()))
                for moment, largest in report["largest"].items():
                    for category, entries in largest.items():
                        for path, nbytes in entries:
                            print(f"  {moment:12} {category:8} {nbytes / MiB:8.3f} MiB  {path}")
                for nbytes, description in report["unreached_after_step"][:4]:
                    print(f"  {'after_step':12} {'unreached':8} {nbytes / MiB:8.3f} MiB  {description}")


if __name__ == "__main__":
    main()
