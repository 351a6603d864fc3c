"""Weight-sync seconds per GB on each route, against this machine's memcpy bandwidth.

    python benchmarks/weight_sync.py [--model small --stage 3 --bucket-mb 64 --repeats 3]

actor_train (deepspeed_train at ZeRO `--stage`, 2 ranks on device slots 0-1) syncs a locally built
Qwen2 model (fp32) into four inference roles, one worker each: hf_infer and vllm on slot 0 (the
colocated route: flat buckets through Ray's shared-memory object store) and hf_infer and vllm on
slot 2 (the broadcast route: gloo from training rank 0). Below ZeRO-3, a second actor_train shares its two
processes with an hf_infer role on the same slots (`share_worker_processes`, as the default RLVR job runs): each
training rank hands its process's hf_infer worker its own parameters, which that worker keeps instead of copying
(`TrainStrategy.yields_live_weights`), both ranks at once. `source only` is the training side alone
(every rank runs `iter_hf_weights`, gathering at ZeRO-3, and nothing is sent): the floor under
every route, printed at stage 3 only (below it the export is free). memcpy is one thread copying
a buffer of the model's size, the fastest a single worker could move the bytes. The fastest of
`--repeats` syncs counts. Prints a markdown table; see docs/weight_sync.md, whose table of this ZeRO stage
`--write-docs` rewrites.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402
from benchmarks.generation_throughput import MODELS  # noqa: E402
from roll.models.tiny import make_tiny_model  # noqa: E402

WORKER = "roll.pipeline.base.rl_workers.ActorWorker"
TARGETS = {  # role name -> (strategy, device slot)
    "hf_infer_colocated": ("hf_infer", "0"),
    "vllm_colocated": ("vllm", "0"),
    "hf_infer_broadcast": ("hf_infer", "2"),
    "vllm_broadcast": ("vllm", "2"),
}
SOURCE_ONLY = "source only (export, gathers)"
SHARED = "hf_infer, shared process (one worker per training rank; it keeps the trainer's parameters, no copy)"
DOC = REPO_ROOT / "docs" / "weight_sync.md"
PACKAGES = ("torch", "deepspeed", "vllm", "ray")
STAGES = (0, 2, 3)
# The ZeRO stages docs/weight_sync.md has a table of.
DOC_STAGES = (3, 2)


def memcpy_gb_per_s(nbytes: int, repeats: int) -> float:
    """One thread copying `nbytes` between two buffers already touched (best of `repeats`)."""
    torch.set_num_threads(1)
    source, target = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def role(name: str, strategy: str, devices: str, model_dir: str, block: dict | None) -> object:
    from roll.configs.worker_config import ModelArguments, StrategyArguments, WorkerConfig

    config = WorkerConfig(
        worker_cls=WORKER,
        device_mapping=devices,
        model_args=ModelArguments(model_name_or_path=model_dir, dtype="fp32"),
        strategy_args=StrategyArguments(strategy_name=strategy, strategy_config=block or {}),
        env_vars={"VLLM_LOGGING_LEVEL": "WARNING"},
    )
    config.resolve(name, 3)
    return config


def zero_block(stage: int) -> dict:
    import yaml

    name = {0: "deepspeed_zero", 2: "deepspeed_zero2", 3: "deepspeed_zero3"}[stage]
    return yaml.safe_load((REPO_ROOT / f"examples/config/{name}.yaml").read_text())[name]


def block(stage: int) -> str:
    """The block of docs/weight_sync.md with the table of ZeRO `stage`."""
    return f"weight_sync-zero{stage}"


BLOCKS = tuple(block(stage) for stage in DOC_STAGES)


def route_label(name: str) -> str:
    """`hf_infer_colocated` -> `hf_infer, colocated`."""
    engine, _, route = name.rpartition("_")
    return f"{engine}, {route}" if engine else name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--stage", type=int, choices=STAGES, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite this stage's table in {DOC.name}")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    import ray

    from roll.distributed.executor.cluster import Cluster, start_hosts
    from roll.distributed.executor.weight_syncer import WeightSyncer
    from roll.distributed.scheduler.initialize import init_ray
    from roll.distributed.scheduler.resource_manager import ResourceManager
    from roll.distributed.weight_sync.plan import devices_per_worker, plan_weight_sync
    from roll.platforms import get_platform

    model_dir = str(make_tiny_model(Path(tempfile.gettempdir()) / f"roll-bench-{args.model}", MODELS[args.model]))
    init_ray(None, "roll-bench", 8, "cpu")
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=3, cpus_per_device=1)
    train = Cluster(WORKER, role("actor_train", "deepspeed_train", "0-1", model_dir, zero_block(args.stage)), manager)
    infer = {name: Cluster(WORKER, role(name, s, d, model_dir, None), manager) for name, (s, d) in TARGETS.items()}
    shared, hosts = [], []
    if args.stage < 3:  # roll keeps ZeRO-3 roles in processes of their own (worker_host.py)
        shared_train = role("actor_train_shared", "deepspeed_train", "0-1", model_dir, zero_block(args.stage))
        hosts = start_hosts(shared_train, manager, "shared")
        shared = [
            Cluster(WORKER, config, manager, hosts)
            for config in (shared_train, role("hf_infer_shared", "hf_infer", "0-1", model_dir, None))
        ]
    for future in [c.initialize(blocking=False) for c in [train, *infer.values(), *shared]]:
        future.get()
    bucket_bytes = args.bucket_mb * 2**20
    n = train.world_size

    def best_of(call: object) -> float:
        best = float("inf")
        for _ in range(args.repeats + 1):  # the first call warms up (allocations, group set-up)
            started = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - started)
        return best

    seconds = {}
    if args.stage == 3:  # below it the export hands out the parameters as they are
        seconds[SOURCE_ONLY] = best_of(lambda: train.send_weights([bucket_bytes] * n, [[]] * n, [None] * n))
    nbytes = 0
    for name, cluster in infer.items():
        plan = plan_weight_sync(devices_per_worker(train.worker_config.devices, 1), [cluster.worker_config.devices])
        syncer = WeightSyncer(train, cluster, plan, bucket_bytes)
        metrics = syncer.sync()
        nbytes = int(metrics["sync/colocated_bytes"] + metrics["sync/broadcast_bytes"])
        seconds[route_label(name)] = best_of(syncer.sync)
    if shared:
        plan = plan_weight_sync(devices_per_worker([0, 1], 1), devices_per_worker([0, 1], 1))
        seconds[SHARED] = best_of(WeightSyncer(shared[0], shared[1], plan, bucket_bytes).sync)
    memcpy = memcpy_gb_per_s(nbytes, args.repeats)
    gigabytes = nbytes / 1e9
    for cluster in [train, *infer.values(), *shared]:
        cluster.shutdown()
    for host in hosts:
        ray.kill(host)
    manager.destroy()
    ray.shutdown()
    lines = [
        f"Model {args.model}: {nbytes / 4e6:.1f}M parameters, {gigabytes:.3f} GB fp32, ZeRO-{args.stage} on 2 ranks, "
        f"buckets of {args.bucket_mb} MiB; memcpy (1 thread) {memcpy:.2f} GB/s:\n",
        "| route | s per sync | s per GB | share of memcpy |",
        "|---|---|---|---|",
    ]
    for name, value in seconds.items():
        lines.append(f"| {name} | {value:.3f} | {value / gigabytes:.2f} | {gigabytes / value / memcpy:.0%} |")
    command = doc_tables.command_line(__file__, sys.argv[1:])
    print(f"{doc_tables.provenance(command, PACKAGES)}\n\n" + "\n".join(lines))
    if args.write_docs:
        doc_tables.write_block(DOC, block(args.stage), command, "\n".join(lines), PACKAGES)


if __name__ == "__main__":
    main()
