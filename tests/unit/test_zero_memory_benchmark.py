"""The ZeRO memory benchmark's pieces that need neither Ray nor DeepSpeed: config, storage census.

Its formulas are roll.pipeline.base.dry_run.model_states.zero_model_states, tested in test_memory_estimate.py.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.zero_memory import classify, engine_census, zero_block


def test_zero_blocks_come_from_the_examples_with_small_buckets() -> None:
    stage1 = zero_block(1, 4096, 0)["zero_optimization"]
    assert stage1["stage"] == 1 and stage1["contiguous_gradients"] and stage1["overlap_comm"]
    assert stage1["reduce_bucket_size"] == stage1["allgather_bucket_size"] == 4096
    stage3 = zero_block(3, 4096, 0)["zero_optimization"]
    assert stage3["stage3_prefetch_bucket_size"] == 4096 and stage3["stage3_param_persistence_threshold"] == 0
    assert zero_block(3, 0, 100)["zero_optimization"]["reduce_bucket_size"] == 50_000_000  # 0 keeps the example
    assert zero_block(0, 4096, 0)["zero_optimization"] == {"stage": 0}


@pytest.mark.parametrize(
    ("path", "category"),
    [
        ("model.lm_head.weight", "params"),
        ("model.model.norm.weight.grad", "grads"),
        ("model.model.embed_tokens.weight.ds_tensor", "params"),
        ("engine.optimizer.bit16_groups_flat[0]", "params"),
        ("engine.optimizer.single_partition_of_fp32_groups[0]", "master"),
        ("engine.optimizer.fp32_partitioned_groups_flat[0]", "master"),
        ("engine.optimizer.averaged_gradients[0][0]", "grads"),
        ("engine.optimizer.grad_partitions_flat_buffer", "grads"),
        ("engine.optimizer.ipg_buckets[torch.bfloat16].buffer[0]", "buckets"),
        ("engine.client_optimizer.state[<Parameter>]['exp_avg_sq']", "moments"),
        ("engine._global_grad_norm", "other"),
    ],
)
def test_classify(path: str, category: str) -> None:
    assert classify(path) == category


class FakeEngine:
    """What the census reads from a DeepSpeed engine: `module` and plain attributes."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(8, 4, dtype=torch.bfloat16)
        flat = torch.zeros(36, dtype=torch.float32)
        self.single_partition_of_fp32_groups = [flat, flat[:18]]  # a view is not counted twice
        self.optimizer = torch.optim.AdamW([flat], lr=0.1)


def test_census_counts_each_storage_once_by_category() -> None:
    engine = FakeEngine()
    engine.module(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    flat = engine.single_partition_of_fp32_groups[0]
    flat.grad = torch.ones_like(flat)
    engine.optimizer.step()
    flat.grad = None
    totals = engine_census(engine).totals()
    assert totals["params"] == 2 * 36  # bf16 weight and bias
    assert totals["grads"] == 2 * 36
    assert totals["master"] == 4 * 36  # also the inner optimizer's param: counted once
    assert totals["moments"] == 2 * 4 * 36
    assert totals["buckets"] == 0 and totals["other"] == 4  # AdamW's step counter
