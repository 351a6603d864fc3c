"""Weight sync end to end on real Ray: ZeRO-3 training on 2 ranks feeds hf_infer, deepspeed_infer and vLLM.

hf_infer and deepspeed_infer share actor_train's devices (the colocated route, shared memory); the
vLLM worker sits on a device of its own (the broadcast route over gloo). After a training step and
a sync every engine must compute what the training model computes. A bf16 vLLM engine whose core runs
in a process of its own takes the weights on both routes (through files when colocated).

The module's roles serve every test; the last one fails syncs into two more of them on purpose and
stops the training workers a crashed receiver leaves waiting, so it must stay last.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import pytest
import ray
import torch

from roll.configs.worker_config import (
    GeneratingArguments,
    ModelArguments,
    StrategyArguments,
    TrainingArguments,
    WorkerConfig,
)
from roll.distributed.executor.cluster import Cluster, start_hosts
from roll.distributed.executor.weight_syncer import WeightSyncer
from roll.distributed.executor.worker_host import IN_PROCESS_STRATEGIES
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.distributed.weight_sync.plan import devices_per_worker, plan_weight_sync
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import TinyModelSpec, make_tiny_model
from roll.pipeline.base.rl_workers import ActorWorker
from roll.platforms import get_platform
from tests.integration.test_deepspeed_strategy import zero_block
from tests.worker_pool import HostPool

pytestmark = pytest.mark.slow
WORKER = "tests.integration.test_weight_sync_e2e.EngineActorWorker"
GREEDY = GeneratingArguments(max_new_tokens=8, do_sample=False)
SAMPLED = GeneratingArguments(max_new_tokens=8, seed=5, num_return_sequences=2)


class EngineActorWorker(ActorWorker):
    """The pipeline's actor worker, plus the engine's own log-probs of its samples."""

    @register(Dispatch.DP_COMPUTE)
    def generate_with_log_probs(self, batch: DataProto, args: GeneratingArguments) -> DataProto:
        generation = self.strategy.generate_with_log_probs(batch, args)
        rollout = self.to_rollout(batch, generation, args)
        return rollout.union(DataProto.from_dict(tensors={"engine_log_probs": generation.log_probs}))

    @register(Dispatch.ONE_TO_ALL)
    def weight_addresses(self) -> dict[str, int]:
        """Where each weight's data lives in this process's memory."""
        model = getattr(self.strategy, "unwrapped_model", None) or self.strategy.model
        return {name: param.data_ptr() for name, param in model.named_parameters()}


def role(
    name: str,
    strategy: str,
    devices: str,
    model_path: str,
    block: dict | None = None,
    dtype: str = "fp32",
    devices_per_worker: int = 1,
) -> WorkerConfig:
    config = WorkerConfig(
        worker_cls=WORKER,
        device_mapping=devices,
        num_devices_per_worker=devices_per_worker,
        infer_batch_size=8,
        model_args=ModelArguments(model_name_or_path=model_path, dtype=dtype),
        strategy_args=StrategyArguments(strategy_name=strategy, strategy_config=block or {}),
        training_args=TrainingArguments(learning_rate=5e-3, per_device_train_batch_size=4),
        env_vars={"VLLM_LOGGING_LEVEL": "WARNING"},
    )
    config.resolve(name, 3)
    return config


@contextmanager
def started(
    configs: dict[str, WorkerConfig],
    manager: ResourceManager,
    pool: HostPool | None = None,
    own_processes: Collection[str] = (),
    close_timeout_s: float = 60,
) -> Iterator[dict[str, Cluster]]:
    """The roles' clusters, initialised concurrently; shut down and their devices released on exit. With `pool`, the
    roles whose strategies run in-process start in its hosts (vLLM starts engine processes of its own), except those
    named in `own_processes`; these also get only 5 s to close, as a failed sync may have left them stuck."""
    clusters = {
        name: pool.start(config.worker_cls, config, manager)
        if pool and config.strategy_args.strategy_name in IN_PROCESS_STRATEGIES and name not in own_processes
        else Cluster(config.worker_cls, config, manager)
        for name, config in configs.items()
    }
    try:
        for future in [cluster.initialize(blocking=False) for cluster in clusters.values()]:
            future.get()
        yield clusters
    finally:
        for name, cluster in clusters.items():
            cluster.shutdown(close_timeout_s=5 if name in own_processes else close_timeout_s)
        manager.destroy()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def prompts(model_path: str) -> DataProto:
    encoded = load_tokenizer(model_path)([f"{a}+{b * 3}=" for a in range(4) for b in range(2)], padding=True)
    return DataProto.from_dict(tensors={k: torch.tensor(encoded[k]) for k in ("input_ids", "attention_mask")})


@pytest.fixture(scope="module")
def roles(
    host_pool: HostPool, model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Cluster]]:
    """ZeRO-3 training on slots 0-1 and the engines every test syncs into, on 3 slots. actor_train and the failing
    test's receivers (one of another shape, one that crashes) run in processes of their own, not the pool's: that
    test stops the training workers its crashed receiver leaves waiting."""
    wide = TinyModelSpec(hidden_size=256, num_heads=8, num_kv_heads=4)
    other_shape = str(make_tiny_model(tmp_path_factory.mktemp("wide"), wide))
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=3, cpus_per_device=1)
    crashed = role("crashed", "hf_infer", "2", model_path)
    crashed.worker_cls = "tests.integration.test_weight_sync_e2e.CrashedReceiverWorker"
    configs = {
        "actor_train": role("actor_train", "deepspeed_train", "0-1", model_path, zero_block(3)),
        "hf_infer": role("hf_infer", "hf_infer", "0-1", model_path),
        "deepspeed_infer": role("deepspeed_infer", "deepspeed_infer", "0-1", model_path, zero_block(3)),
        "vllm": role("vllm", "vllm", "2", model_path),
        # On training rank 1's slot, with the engine core in a process of its own: the colocated route's buckets
        # reach it as files.
        "vllm_bf16": role("vllm_bf16", "vllm", "1", model_path, {"multiprocessing": True}, dtype="bf16"),
        "vllm_tp2": role("vllm_tp2", "vllm", "1-2", model_path, {"tensor_parallel_size": 2}, devices_per_worker=2),
        # ZeRO-3 inference loads collectively; worker 0 shares training rank 0's slot, worker 1 has its own.
        "deepspeed_infer_mixed": role("deepspeed_infer_mixed", "deepspeed_infer", "0,2", model_path, zero_block(3)),
        "wide": role("wide", "hf_infer", "2", other_shape),
        "crashed": crashed,
    }
    with started(configs, manager, host_pool, own_processes={"actor_train", "wide", "crashed"}) as clusters:
        yield clusters


def syncer(roles: dict[str, Cluster], target: str, method: str = "auto") -> WeightSyncer:
    train, infer = roles["actor_train"], roles[target]
    config = infer.worker_config
    plan = plan_weight_sync(
        devices_per_worker(train.worker_config.devices, 1),
        devices_per_worker(config.devices, config.num_devices_per_worker),
        infer.weight_sync_shards(),
        method=method,
    )
    return WeightSyncer(train, infer, plan, bucket_bytes=2**16)


def train_step(roles: dict[str, Cluster], prompts: DataProto) -> None:
    """One supervised step on the training model's own greedy answers, at a learning rate that moves every weight."""
    batch = roles["actor_train"].generate(prompts, GREEDY)
    roles["actor_train"].sft_step(batch)


def log_probs(cluster: Cluster, batch: DataProto) -> torch.Tensor:
    return cluster.compute_log_probs(batch).batch["log_probs"]


def test_every_engine_computes_what_the_trainer_computes_after_a_sync(
    roles: dict[str, Cluster], prompts: DataProto
) -> None:
    routes = {
        "hf_infer": syncer(roles, "hf_infer"),
        "deepspeed_infer": syncer(roles, "deepspeed_infer"),
        "vllm": syncer(roles, "vllm"),
    }
    assert routes["hf_infer"].plan.colocated == {0: (0,), 1: (1,)} and routes["vllm"].plan.broadcast_ranks == {0: (1,)}
    for step in range(2):  # the second sync reuses the broadcast group
        train_step(roles, prompts)
        expected = roles["actor_train"].generate(prompts, GREEDY)
        trainer_log_probs = log_probs(roles["actor_train"], expected)
        if step == 0:
            stale = log_probs(roles["hf_infer"], expected)
            assert (stale - trainer_log_probs).abs().max() > 1e-3  # the step changed the model visibly
        metrics = {name: route.sync() for name, route in routes.items()}
        assert metrics["vllm"]["sync/broadcast_bytes"] > 0 and metrics["hf_infer"]["sync/colocated_bytes"] > 0
        for name in ("hf_infer", "deepspeed_infer"):
            torch.testing.assert_close(log_probs(roles[name], expected), trainer_log_probs, rtol=0, atol=1e-5)
        generated = roles["vllm"].generate(prompts, GREEDY)
        assert torch.equal(generated.batch["responses"], expected.batch["responses"])


@pytest.mark.slow
def test_roles_sharing_a_process_per_device_sync_in_memory(
    ray_session: None, model_path: str, prompts: DataProto
) -> None:
    """A trainer and an hf_infer role in the same WorkerHosts (share_worker_processes): one process per rank, and
    the sync hands each bucket over in the process, exactly: hf_infer keeps the trainer's own parameters (ZeRO-2 on
    CPU moves nothing between phases), so it holds no copy and follows every later step."""
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=3, cpus_per_device=1)
    configs = {
        "actor_train": role("actor_train", "deepspeed_train", "0-1", model_path, zero_block(2)),
        "hf_infer": role("hf_infer", "hf_infer", "0-1", model_path),
    }
    hosts = start_hosts(configs["actor_train"], manager, "shared")
    clusters = {name: Cluster(config.worker_cls, config, manager, hosts) for name, config in configs.items()}
    try:
        for future in [cluster.initialize(blocking=False) for cluster in clusters.values()]:
            future.get()
        pids = {name: [d["pid"] for d in cluster.describe()] for name, cluster in clusters.items()}
        assert pids["actor_train"] == pids["hf_infer"] and len(set(pids["actor_train"])) == 2
        route = syncer(clusters, "hf_infer")
        train_step(clusters, prompts)
        expected = clusters["actor_train"].generate(prompts, GREEDY)
        trainer_log_probs = log_probs(clusters["actor_train"], expected)
        assert (log_probs(clusters["hf_infer"], expected) - trainer_log_probs).abs().max() > 1e-3
        assert route.sync()["sync/colocated_bytes"] > 0
        torch.testing.assert_close(log_probs(clusters["hf_infer"], expected), trainer_log_probs, rtol=0, atol=1e-5)
        assert clusters["hf_infer"].weight_addresses() == clusters["actor_train"].weight_addresses()
        train_step(clusters, prompts)
        route.sync()
        moved = log_probs(clusters["actor_train"], expected)
        assert (moved - trainer_log_probs).abs().max() > 1e-3
        torch.testing.assert_close(log_probs(clusters["hf_infer"], expected), moved, rtol=0, atol=1e-5)
    finally:
        for cluster in clusters.values():
            cluster.shutdown()
        for host in hosts:
            ray.kill(host)
        manager.destroy()


def test_forced_broadcast_reaches_colocated_workers_too(roles: dict[str, Cluster], prompts: DataProto) -> None:
    route = syncer(roles, "hf_infer", method="broadcast")
    assert route.plan.colocated == {} and route.plan.broadcast_world_size == 3
    train_step(roles, prompts)
    expected = roles["actor_train"].generate(prompts, GREEDY)
    metrics = route.sync()
    assert metrics["sync/colocated_bytes"] == 0 and metrics["sync/broadcast_bytes"] > 0
    torch.testing.assert_close(
        log_probs(roles["hf_infer"], expected), log_probs(roles["actor_train"], expected), rtol=0, atol=1e-5
    )


def test_a_bf16_engine_in_its_own_process_agrees_with_the_fp32_trainer_after_either_route(
    roles: dict[str, Cluster], prompts: DataProto
) -> None:
    """vLLM in bf16 with its engine core in a process of its own, on training rank 1's slot: through files, then
    over the broadcast group, it computes what the fp32 trainer computes within bf16 rounding."""
    engine = roles["vllm_bf16"]
    # One 4-token prompt as the engine's first step: no GEMM before attention is big enough to make
    # oneDNN ask for AMX, so this catches an engine process that lacks AMX permission.
    engine.generate(prompts[:1], GREEDY)
    for method in ("auto", "broadcast"):
        route = syncer(roles, "vllm_bf16", method)
        if method == "auto":
            assert route.plan.colocated == {1: (0,)} and not route.plan.broadcast_ranks
        else:
            assert route.plan.colocated == {} and route.plan.broadcast_ranks == {0: (1,)}
        train_step(roles, prompts)
        metrics = route.sync()
        assert metrics["sync/colocated_bytes" if method == "auto" else "sync/broadcast_bytes"] > 0
        sampled = engine.generate_with_log_probs(prompts, SAMPLED)
        mask = sampled.batch["response_mask"].bool()
        trainer = log_probs(roles["actor_train"], sampled)[mask]
        difference = (sampled.batch["engine_log_probs"][mask] - trainer).abs()
        print(f"bf16 engine ({method}) vs fp32 trainer, {mask.sum()} tokens: ", end="")
        print(f"max {difference.max():.2e}, mean {difference.mean():.2e}")
        assert difference.max() < 5e-2 and difference.mean() < 1e-2  # bf16 keeps 8 bits of mantissa
        greedy = engine.generate(prompts, GREEDY).batch["responses"]
        expected = roles["actor_train"].generate(prompts, GREEDY).batch["responses"]
        assert (greedy == expected).all(dim=1).float().mean() >= 0.75  # near-ties may flip in bf16


@pytest.mark.parametrize("method", ["auto", "broadcast"])
def test_a_tensor_parallel_engine_takes_weights_on_either_route(
    roles: dict[str, Cluster], prompts: DataProto, method: str
) -> None:
    """vLLM with 2 engine processes on slots 1-2: from training rank 1 through files, or one group rank per shard."""
    route = syncer(roles, "vllm_tp2", method)
    if method == "auto":
        assert route.plan.colocated == {1: (0,)}  # slot 1 is training rank 1's
    else:
        assert route.plan.broadcast_ranks == {0: (1, 2)} and route.plan.broadcast_world_size == 3
    train_step(roles, prompts)
    route.sync()
    expected = roles["actor_train"].generate(prompts, GREEDY)
    assert torch.equal(roles["vllm_tp2"].generate(prompts, GREEDY).batch["responses"], expected.batch["responses"])


def test_a_collectively_loading_engine_takes_weights_on_both_routes_at_once(
    roles: dict[str, Cluster], prompts: DataProto
) -> None:
    """ZeRO-3 deepspeed_infer with one colocated and one broadcast worker: each bucket's gather needs both.

    Training rank 0 hands bucket k to its colocated worker while it broadcasts the same bucket; waiting
    for the hand-over first deadlocked (the colocated worker's gather waited for the broadcast worker).
    """
    route = syncer(roles, "deepspeed_infer_mixed")
    assert route.plan.colocated == {0: (0,)} and route.plan.broadcast_ranks == {1: (1,)}
    train_step(roles, prompts)
    metrics = route.sync()
    assert metrics["sync/colocated_bytes"] > 0 and metrics["sync/broadcast_bytes"] > 0
    expected = roles["actor_train"].generate(prompts, GREEDY)
    torch.testing.assert_close(
        log_probs(roles["deepspeed_infer_mixed"], expected),
        log_probs(roles["actor_train"], expected),
        rtol=0,
        atol=1e-5,
    )


class CrashedReceiverWorker(EngineActorWorker):
    """A receiver that fails at once, before it takes part in the sync (as a crashed engine would)."""

    @register(Dispatch.ONE_TO_ALL)
    def receive_weight_broadcast(self) -> int:
        raise RuntimeError("receiver crashed")


def test_a_failed_sync_ends_every_participant_with_the_error(roles: dict[str, Cluster]) -> None:
    """A rejected bucket: rank 0 aborts, rank 1 finishes its ZeRO-3 gathers, the receiver raises; nobody hangs.

    A receiver that crashes before taking part leaves the source waiting for its verdict: after the grace
    period the waiting workers are stopped and named in the error. Last in the module: it ends actor_train.
    """
    train = roles["actor_train"]
    rejected = syncer(roles, "wide")
    started = time.perf_counter()
    with pytest.raises(Exception, match=r"weight '[\w.]+' has shape \(\d+(, \d+)*\) but the model's is"):
        rejected.sync()
    assert time.perf_counter() - started < 60
    assert train.describe()  # every training rank finished its call: the role is still usable

    crashed = syncer(roles, "crashed")
    crashed.abort_grace_s = 3
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"receiver crashed(.|\n)*actor_train rank 0 still waited"):
        crashed.sync()
    assert time.perf_counter() - started < 60
