"""Losses normalise over the global batch: 2 data-parallel DeepSpeed ranks (ZeRO stage 0, gloo) whose rows differ
in length, each in 2 micro-batches, apply the gradients 1 rank applies to the same rows in one micro-batch.

Rank 0 gets the short responses (one of them empty, so the ranks also differ in non-empty sequences), rank 1
the long ones. Normalising each rank over its own tokens or sequences, with DeepSpeed averaging the ranks,
weighs rank 0's tokens more than rank 1's; the PRM's step BCE averaged per micro-batch does the same at its
step ends. The gradients are read as the engine steps (tests/gradient_workers.py); the learning rate is too
small to move an fp32 weight, so every update of a cluster sees the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import ModelArguments, StrategyArguments, TrainingArguments, WorkerConfig
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.models.tiny import TinyModelSpec, make_tiny_model
from tests.conftest import CONFIG_DIR
from tests.padded_rollouts import padded_rollout
from tests.worker_pool import HostPool

pytestmark = pytest.mark.slow
ROWS, PROMPT, RESPONSE = 8, 4, 8  # one optimizer step of 8 rows: 2 rows x 2 accumulation x 2 ranks, or 8 x 1 x 1
PROMPT_LENGTHS = [2, 4, 3, 1, 4, 2, 3, 4]
RESPONSE_LENGTHS = [2, 0, 3, 1, 8, 7, 8, 6]  # rank 0's rows are the first 4
STEP_ENDS = [[1], [], [2], [0], [1, 4, 7], [1, 4], [1, 4, 7], [1, 4]]  # the PRM's: 3 on rank 0, 10 on rank 1
MODES = ["token-mean", "seq-mean-token-sum"]
TOLERANCE = {"atol": 1e-6, "rtol": 1e-4}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    spec = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), spec))


def rollout() -> DataProto:
    """PPO targets on the response tokens, PRM step ends and their labels."""
    tensors, generator = padded_rollout(PROMPT_LENGTHS, RESPONSE_LENGTHS, (PROMPT, RESPONSE), vocab=60, seed=7)
    mask = tensors["response_mask"]
    step_mask = torch.zeros_like(mask)
    for row, ends in enumerate(STEP_ENDS):
        step_mask[row, ends] = 1
    tensors.update(
        advantages=torch.randn(ROWS, RESPONSE, generator=generator) * mask,
        old_log_probs=-4.0 + 0.3 * torch.randn(ROWS, RESPONSE, generator=generator),
        step_mask=step_mask,
        step_labels=(torch.rand(ROWS, RESPONSE, generator=generator) > 0.5).float() * step_mask,
    )
    return DataProto.from_dict(tensors=tensors)


def start(pool: HostPool, manager: ResourceManager, worker: str, model_path: str, ranks: int) -> Cluster:
    """A ZeRO stage 0 role on `ranks` ranks whose one optimizer step takes all the rollout's rows: on 2 ranks in
    micro-batches of 2 rows, on 1 in one micro-batch (the plain loss over all rows, nothing to normalise)."""
    block = copy.deepcopy(yaml.safe_load((CONFIG_DIR / "deepspeed_zero.yaml").read_text())["deepspeed_zero"])
    config = WorkerConfig(
        worker_cls=worker,
        device_mapping="0-1" if ranks == 2 else "0",
        infer_batch_size=2,
        model_args=ModelArguments(model_name_or_path=model_path, dtype="fp32"),
        strategy_args=StrategyArguments(strategy_name="deepspeed_train", strategy_config=block),
        training_args=TrainingArguments(
            learning_rate=1e-12,
            per_device_train_batch_size=2 if ranks == 2 else ROWS,
            gradient_accumulation_steps=2 if ranks == 2 else 1,
        ),
    )
    config.resolve("actor_train", manager.total_devices)
    cluster = pool.start(worker, config, manager)
    cluster.initialize()
    cluster.record_gradients()
    return cluster


def updates(pool: HostPool, manager: ResourceManager, worker: str, model_path: str, ranks: int, calls: dict) -> dict:
    """Each call's (global loss, gradients) on a cluster of `ranks` ranks; `calls` maps a name to a function
    of the cluster that runs one update."""
    cluster = start(pool, manager, worker, model_path, ranks)
    try:
        results = {}
        for name, call in calls.items():
            metrics = call(cluster)
            gradients = cluster.last_gradients()
            assert all(metrics[rank]["loss"] == metrics[0]["loss"] for rank in range(ranks))
            results[name] = (metrics[0]["loss"], gradients[0])
        return results
    finally:
        cluster.shutdown()


def mismatches(two_ranks: dict, one_rank: dict) -> list[str]:
    """The updates whose global loss or gradients differ between the two runs."""
    wrong = []
    for name, (loss, gradients) in one_rank.items():
        two_rank_loss, two_rank_gradients = two_ranks[name]
        assert gradients.keys() == two_rank_gradients.keys() and gradients, name
        if two_rank_loss != pytest.approx(loss, abs=1e-6):
            wrong.append(f"{name}: loss {two_rank_loss} on 2 ranks, {loss} on 1")
        differing = [
            key for key, value in gradients.items() if not torch.allclose(two_rank_gradients[key], value, **TOLERANCE)
        ]
        if differing:
            wrong.append(
                f"{name}: the gradients of {len(differing)} of {len(gradients)} parameters, e.g. {differing[0]}"
            )
    return wrong


def test_actor_and_sft_updates_on_two_ranks_equal_one_rank(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str
) -> None:
    batch = rollout()
    calls = {mode: lambda c, m=mode: c.train_step(batch, AlgorithmArguments(loss_agg_mode=m)) for mode in MODES}
    calls["sft"] = lambda c: c.sft_step(batch)
    worker = "tests.gradient_workers.ActorGradientWorker"
    two_ranks = updates(host_pool, resource_manager, worker, model_path, 2, calls)
    one_rank = updates(host_pool, resource_manager, worker, model_path, 1, calls)
    wrong = mismatches(two_ranks, one_rank)
    assert not wrong, "\n".join(wrong)


def test_process_reward_update_on_two_ranks_equals_one_rank(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str
) -> None:
    batch = rollout()
    calls = {"step bce": lambda c: c.process_reward_step(batch)}
    worker = "tests.gradient_workers.ProcessRewardTrainGradientWorker"
    two_ranks = updates(host_pool, resource_manager, worker, model_path, 2, calls)
    one_rank = updates(host_pool, resource_manager, worker, model_path, 1, calls)
    wrong = mismatches(two_ranks, one_rank)
    assert not wrong, "\n".join(wrong)
