"""The per-rank memory estimate (roll.pipeline.base.dry_run) against what a real DeepSpeed run holds.

    python benchmarks/memory_estimate.py [--stages 0 1 2 3 --checkpointing-stages 3 --write-docs]

For each ZeRO stage (the examples/config blocks as they are; stage 1 is the zero2 block at stage 1) it
starts a 2-rank bf16 `deepspeed_train` role on CPU whose worker (`EstimateWorker`, built on
benchmarks/zero_memory.py's `MemoryWorker`) runs two optimizer steps of random tokens. The first is
zero_memory's step with its census of engine tensors (model states); the second, with every rank's
peak RSS reset before it, gives the steady state: RSS between steps, the peak during forward and
backward, the peak during the optimizer step. Each is compared with `estimate_rank` of the same
role config, as a dry run would compute it: model states (target within 5%), peak RSS over the
runtime before the model (target within 25%). The workers run with glibc's mmap threshold fixed, so
that RSS follows the live tensors; `--malloc dynamic` measures under glibc's defaults instead.
`--write-docs` puts the tables into docs/memory_estimate.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402
from benchmarks.zero_memory import (  # noqa: E402
    MemoryWorker,
    current_rss,
    lm_loss,
    model_states,
    zero_block,
)
from roll.configs.worker_config import (  # noqa: E402
    ModelArguments,
    StrategyArguments,
    TrainingArguments,
    WorkerConfig,
)
from roll.distributed.scheduler.decorator import Dispatch, register  # noqa: E402
from roll.pipeline.base.dry_run.model_shape import model_shape  # noqa: E402
from roll.pipeline.base.dry_run.rank_estimate import RankEstimate, estimate_rank  # noqa: E402

WORKER = "benchmarks.memory_estimate.EstimateWorker"
WORLD_SIZE = 2
MiB = 2**20
DOC = REPO_ROOT / "docs" / "memory_estimate.md"
PACKAGES = ("torch", "deepspeed", "transformers")
# glibc's malloc raises its mmap threshold each time a large block is freed, after which blocks up to 32 MiB
# come from the heap, where freed activations stay resident and fragment. A fixed threshold (which also fixes
# the trim threshold) keeps every block above it in its own mapping, returned when freed: RSS follows the
# live tensors. "dynamic" is glibc's default.
MALLOC_ENV = {"fixed": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "dynamic": {}}
STATE_NAMES = ("params", "grads", "fp32 master", "Adam m+v")


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux clear_refs 5); return that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return current_rss()


def peak_rss_since_reset() -> int:
    """This process's peak RSS since the last reset, in bytes (VmHWM, which Linux reports in KiB)."""
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read()).group(1)) * 1024


class EstimateWorker(MemoryWorker):
    """A deepspeed_train rank: zero_memory's census step, then a second step measured phase by phase."""

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> None:
        import deepspeed  # noqa: F401  (the runtime's own memory, not the model's: loaded before the baseline)

        super().initialize()

    @register(Dispatch.ONE_TO_ALL)
    def measure_steady(self, seq_len: int, seed: int) -> dict[str, Any]:
        """The census step (Adam moments exist after it), then one more with its peaks; every RSS in bytes."""
        report = self.measure(seq_len, seed)
        engine = self.strategy.engine
        args = self.worker_config.training_args
        generator = torch.Generator().manual_seed(seed + 100 + self.rank)
        rss = {"before_model": self.rss["before_model"], "between_steps": reset_peak_rss()}
        for micro in range(args.gradient_accumulation_steps):
            shape = (args.per_device_train_batch_size, seq_len)
            input_ids = torch.randint(4, engine.module.config.vocab_size, shape, generator=generator)
            output = engine(input_ids=input_ids, use_cache=False)
            engine.backward(lm_loss(output.logits, input_ids))
            del output
            if micro == args.gradient_accumulation_steps - 1:
                rss["train_peak"] = peak_rss_since_reset()
                reset_peak_rss()
            engine.step()
        rss["step_peak"] = peak_rss_since_reset()
        report["steady"] = rss
        return report


def role_config(model_path: str, stage: int, checkpointing: bool, options: argparse.Namespace) -> WorkerConfig:
    """The bf16 deepspeed_train role of a run: the examples' ZeRO block of `stage`, as a pipeline would have it."""
    config = WorkerConfig(
        worker_cls=WORKER,
        env_vars=MALLOC_ENV[options.malloc],
        device_mapping=f"0-{WORLD_SIZE - 1}",
        infer_batch_size=options.micro_batch,
        model_args=ModelArguments(model_name_or_path=model_path, dtype="bf16"),
        strategy_args=StrategyArguments(
            strategy_name="deepspeed_train",
            # 0 keeps the examples' bucket sizes; 1e5 is their persistence threshold.
            strategy_config=zero_block(stage, bucket_elements=0, persistence_threshold=100_000),
        ),
        training_args=TrainingArguments(
            learning_rate=1e-4,
            per_device_train_batch_size=options.micro_batch,
            gradient_accumulation_steps=options.accumulation,
            gradient_checkpointing=checkpointing,
        ),
    )
    config.resolve("actor_train", WORLD_SIZE)
    return config


def estimate_of(config: WorkerConfig, seq_len: int) -> RankEstimate:
    """What a dry run estimates for a rank of `config`: sequences of `seq_len`, all but the first scored."""
    estimate = estimate_rank(config, prompt_length=1, response_length=seq_len - 1, ranks_on_node=WORLD_SIZE)
    assert estimate is not None
    return estimate


def run(manager: Any, config: WorkerConfig, options: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the role, run its two steps, return every rank's report."""
    from roll.distributed.executor.cluster import Cluster

    cluster = Cluster(WORKER, config, manager)
    try:
        cluster.initialize()
        reports = cluster.measure_steady(options.seq_len, options.seed)
        cluster.shutdown_strategy()
    finally:
        cluster.shutdown()
    return reports


def _ratio(measured: float, estimated: float) -> str:
    return f"{measured / MiB:.1f} / {estimated / MiB:.1f} (**{measured / estimated:.2f}**)"


def results_table(rows: list[tuple[int, bool, dict[str, Any], RankEstimate]]) -> str:
    """One row per run and rank: measured / estimated MiB and their ratio for states, and RSS over the baseline."""
    header = (
        "| stage | grad. ckpt | rank | model states: census / estimate | RSS between steps / resident estimate | "
        "peak in forward+backward / estimate | peak in optimizer step / estimate | **peak / estimate** |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for stage, checkpointing, report, estimate in rows:
        measured_states = sum(v for k, v in model_states(report).items() if k not in ("buckets", "other"))
        estimated_states = sum(i.nbytes for i in estimate.resident if i.name in STATE_NAMES)
        rss = report["steady"]
        base = rss["before_model"]
        resident = estimate.bytes_of(estimate.resident)
        train = resident + estimate.bytes_of(estimate.phases["train micro-batch"])
        step = resident + estimate.bytes_of(estimate.phases["optimizer step"])
        peak = max(rss["train_peak"], rss["step_peak"]) - base
        cells = [
            _ratio(measured_states, estimated_states),
            _ratio(rss["between_steps"] - base, resident),
            _ratio(rss["train_peak"] - base, train),
            _ratio(rss["step_peak"] - base, step),
            _ratio(peak, estimate.total),
        ]
        ckpt = "yes" if checkpointing else "no"
        lines.append(f"| {stage} | {ckpt} | {report['rank']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def estimate_table(estimates: dict[tuple[int, bool], RankEstimate]) -> str:
    """The estimate's items per run, MiB: resident states and what each phase adds."""
    header = "| stage | grad. ckpt | resident | forward+backward adds | optimizer step adds | estimate (peak phase) |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]

    def items(values: tuple[Any, ...]) -> str:
        return ", ".join(f"{i.name} {i.nbytes / MiB:.1f}" for i in values) or "nothing"

    for (stage, checkpointing), estimate in estimates.items():
        cells = [
            items(estimate.resident),
            items(estimate.phases["train micro-batch"]),
            items(estimate.phases["optimizer step"]),
            f"{estimate.total / MiB:.1f} ({estimate.peak_phase})",
        ]
        lines.append(f"| {stage} | {'yes' if checkpointing else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def block(malloc: str) -> str:
    """The block of docs/memory_estimate.md that holds the results under glibc malloc setting `malloc`."""
    return f"memory_estimate-{malloc}"


BLOCKS = tuple(block(m) for m in sorted(MALLOC_ENV))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument(
        "--checkpointing-stages",
        type=int,
        nargs="*",
        default=[3],
        choices=[0, 1, 2, 3],
        help="stages to run once more with gradient checkpointing",
    )
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--malloc",
        choices=sorted(MALLOC_ENV),
        default="fixed",
        help="glibc's mmap threshold in the workers: fixed at 128 KiB (RSS follows live tensors) or glibc's dynamic",
    )
    parser.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOC.relative_to(REPO_ROOT)}")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    # Ray workers import EstimateWorker as `benchmarks.memory_estimate`; they inherit this environment.
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
        max_position_embeddings=max(512, options.seq_len),
    )
    runs = [(s, False) for s in options.stages] + [(s, True) for s in options.checkpointing_stages]
    rows: list[tuple[int, bool, dict[str, Any], RankEstimate]] = []
    estimates: dict[tuple[int, bool], RankEstimate] = {}
    init_ray(None, "roll-benchmarks", 2 * WORLD_SIZE, "cpu")
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=WORLD_SIZE, cpus_per_device=1)
    try:
        with tempfile.TemporaryDirectory(prefix="memory_estimate_") as tmp:
            model_path = str(make_tiny_model(tmp, spec))
            psi = model_shape(model_path).param_count()
            for stage, checkpointing in runs:
                start = time.perf_counter()
                config = role_config(model_path, stage, checkpointing, options)
                estimates[stage, checkpointing] = estimate_of(config, options.seq_len)
                reports = sorted(run(manager, config, options), key=lambda r: r["rank"])
                if reports[0]["psi"] != psi:
                    raise RuntimeError(f"the engine trains {reports[0]['psi']:,} parameters; estimated: {psi:,}")
                rows += [(stage, checkpointing, report, estimates[stage, checkpointing]) for report in reports]
                seconds = time.perf_counter() - start
                print(f"stage {stage}, checkpointing {checkpointing}: {seconds:.0f} s", file=sys.stderr)
    finally:
        manager.destroy()
        ray.shutdown()
    command = doc_tables.command_line(__file__, argv if argv is not None else sys.argv[1:])
    section = "\n\n".join(
        [
            f"Model: {spec}, Ψ = {psi:,} parameters; N = {WORLD_SIZE} ranks, bf16, micro-batch "
            f"{options.micro_batch} x {options.seq_len} tokens, {options.accumulation} micro-batches per step; "
            f"malloc: {options.malloc} ({MALLOC_ENV[options.malloc] or 'no MALLOC_ variables'}).",
            "Measured / estimated MiB (2^20 bytes), RSS over each rank's RSS before the model:",
            results_table(rows),
            "The estimate, MiB:",
            estimate_table(estimates),
        ]
    )
    print(f"{doc_tables.provenance(command, PACKAGES)}\n\n{section}")
    if options.write_docs:
        doc_tables.write_block(DOC, block(options.malloc), command, section, PACKAGES)


if __name__ == "__main__":
    main()
