"""Token-budget and packed micro-batches through real DeepSpeed (ZeRO-3, 2 CPU ranks over gloo).

The ranks get rows of different lengths, so their token budgets form different numbers of micro-batches:
they must agree on one count (ZeRO-3 gathers parameters in every forward) or the step hangs. Log-probs,
the loss and the gradient norm of the update must equal the padded run's. One cluster runs the three
layouts; its learning rate is too small to move an fp32 weight, so every layout sees the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import ModelArguments, StrategyArguments, TrainingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.models.tiny import TinyModelSpec, make_tiny_model
from tests.conftest import CONFIG_DIR
from tests.padded_rollouts import padded_rollout
from tests.worker_pool import HostPool

WORKER = "tests.budget_workers.BudgetActorWorker"
ROWS, PROMPT, RESPONSE = 16, 6, 10  # 8 rows per rank: one optimizer step of 2 rows x 4 accumulation
LAYOUTS = {"padded": (None, False), "token budget": (32, False), "packed": (32, True)}


def rollout(vocab: int) -> DataProto:
    """Rank 0's rows (the first 8) are short, rank 1's long: their budgets form different micro-batch counts."""
    prompt_lengths = [1, 2, 1, 3, 2, 1, 2, 1, 6, 5, 6, 4, 6, 5, 6, 3]
    response_lengths = [2, 0, 3, 1, 2, 4, 1, 2, 10, 9, 7, 10, 8, 10, 6, 9]
    tensors, generator = padded_rollout(prompt_lengths, response_lengths, (PROMPT, RESPONSE), vocab, seed=5)
    tensors["advantages"] = torch.randn(ROWS, RESPONSE, generator=generator) * tensors["response_mask"]
    tensors["old_log_probs"] = -4.0 + 0.3 * torch.randn(ROWS, RESPONSE, generator=generator)
    return DataProto.from_dict(tensors=tensors)


@pytest.mark.slow
def test_budgeted_and_packed_zero3_steps_equal_the_padded_step(
    host_pool: HostPool, resource_manager: ResourceManager, tmp_path
) -> None:
    spec = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    model_path = str(make_tiny_model(tmp_path / "tiny", spec))
    batch = rollout(vocab=60)
    mask = batch.batch["response_mask"].bool()
    block = copy.deepcopy(yaml.safe_load((CONFIG_DIR / "deepspeed_zero3.yaml").read_text())["deepspeed_zero3"])
    config = WorkerConfig(
        worker_cls=WORKER,
        device_mapping="0-1",
        infer_batch_size=4,
        model_args=ModelArguments(model_name_or_path=model_path, dtype="fp32"),
        strategy_args=StrategyArguments(strategy_name="deepspeed_train", strategy_config=block),
        training_args=TrainingArguments(
            learning_rate=1e-12, per_device_train_batch_size=2, gradient_accumulation_steps=4
        ),
    )
    config.resolve("actor_train", resource_manager.total_devices)
    cluster = host_pool.start(WORKER, config, resource_manager)
    cluster.initialize()
    try:
        results = {}
        for layout, (budget, packing) in LAYOUTS.items():
            cluster.set_micro_batching(budget, packing)
            log_probs = cluster.compute_log_probs(batch).batch["log_probs"]
            metrics = cluster.train_step(batch, AlgorithmArguments(loss_agg_mode="token-mean"))[0]
            results[layout] = (log_probs, metrics)
    finally:
        cluster.shutdown()
    padded_log_probs, padded = results["padded"]
    for layout in ("token budget", "packed"):
        log_probs, metrics = results[layout]
        torch.testing.assert_close(log_probs[mask], padded_log_probs[mask], atol=1e-5, rtol=0, msg=layout)
        for key in ("loss", "grad_norm"):
            assert metrics[key] == pytest.approx(padded[key], abs=1e-5), (layout, key)
    # One optimizer step per train_step on every layout.
    assert [results[layout][1]["global_step"] for layout in LAYOUTS] == [1.0, 2.0, 3.0]
