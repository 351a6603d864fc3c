"""AutoTP without an engine: the gather of fake shards, the checkpoint's tensor-parallel check, the dry-run plan."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from roll.configs.schema import ConfigError
from roll.configs.worker_config import ModelArguments, StrategyArguments, WorkerConfig
from roll.distributed.strategy.registry import check_strategy_args
from roll.models.hf_weights import hf_named_weights
from roll.pipeline.base.dry_run.rank_estimate import estimate_rank
from roll.third_party.deepspeed import checkpoint
from roll.third_party.deepspeed.autotp import gathered_parameters, tensor_parallel_layer
from tests.conftest import CONFIG_DIR
from tests.unit.test_dry_run import report


class FakeColumnShard(torch.nn.Module):
    """Rank 0's half of a column-parallel linear layer; `gather_params` concatenates the peer's half as AutoTP would."""

    def __init__(self, full: torch.nn.Linear) -> None:
        super().__init__()
        self.full = (full.weight.detach().clone(), full.bias.detach().clone())
        half = full.out_features // 2
        self.weight = torch.nn.Parameter(self.full[0][:half].clone())
        self.bias = torch.nn.Parameter(self.full[1][:half].clone())
        for param in (self.weight, self.bias):
            param.gather_params = self.gather_params

    def gather_params(self, params: list[torch.Tensor]) -> None:
        for param, full in zip(params, self.full, strict=True):
            param.data = torch.cat([param.data, full[param.shape[0] :]])


def sharded_model() -> tuple[torch.nn.Sequential, torch.nn.Sequential]:
    """A two-layer model and the same model with its first layer replaced by rank 0's shard."""
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    sharded = torch.nn.Sequential(FakeColumnShard(full[0]), full[1])
    return full, sharded


def test_gathered_parameters_gives_full_values_and_puts_each_shard_back() -> None:
    full, sharded = sharded_model()
    shard = sharded[0].weight.data_ptr()
    assert tensor_parallel_layer(sharded[0].weight) is sharded[0] and tensor_parallel_layer(full[1].weight) is None
    with gathered_parameters([sharded[0].weight, sharded[1].weight], zero3=False):
        assert torch.equal(sharded[0].weight, full[0].weight) and torch.equal(sharded[0].bias, full[0].bias)
        assert torch.equal(sharded[1].weight, full[1].weight)
    assert sharded[0].weight.data_ptr() == shard and sharded[0].weight.shape == (
        2,
        3,
    )  # the same shard back


def test_exported_weights_are_the_unsharded_models() -> None:
    full, sharded = sharded_model()
    exported = dict(hf_named_weights(sharded, functools.partial(gathered_parameters, zero3=False)))
    assert exported.keys() == full.state_dict().keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in full.state_dict().items())
    assert sharded[0].weight.shape == (2, 3)


def test_gathered_parameters_hands_deepspeed_layers_their_own_bias() -> None:
    """A sub-parameter layer (fused QKV) tells its bias from its weight by identity, as every AutoTP layer does."""
    from deepspeed.module_inject.layers import SubParamLinearLayer

    torch.manual_seed(0)
    full = torch.nn.Linear(4, 6)
    expected = {name: tensor.detach().clone() for name, tensor in full.state_dict().items()}
    layer = SubParamLinearLayer(full, None, shape=(3, -1), partition_dim=0, name="qkv_proj")  # no group: 1 shard
    held = [layer.weight.data_ptr(), layer.bias.data_ptr()]
    with gathered_parameters([layer.weight, layer.bias], zero3=False):
        assert torch.equal(layer.weight, expected["weight"]) and torch.equal(layer.bias, expected["bias"])
    assert [layer.weight.data_ptr(), layer.bias.data_ptr()] == held  # the same shard tensors back


class FakeEngine:
    """What checkpoint.load asks of an engine before DeepSpeed reads the files."""

    def __init__(self, autotp_size: int) -> None:
        self._autotp_size = autotp_size

    def autotp_size(self) -> int:
        return self._autotp_size


def test_resume_at_another_tensor_parallel_size_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "step4").mkdir()
    meta = {"tag": "step4", "dp_size": 1, "tp_size": 2, "zero_stage": 1}
    (tmp_path / "step4" / checkpoint.MARKER).write_text(json.dumps(meta))
    monkeypatch.setattr(checkpoint, "_rank_and_world", lambda: (0, 2))
    with pytest.raises(ValueError, match=r"written with tensor_parallel.autotp_size=2 and this role runs 1; resume"):
        checkpoint.load(FakeEngine(0), str(tmp_path), "step4")


def tiny_train_role(block: dict[str, Any]) -> WorkerConfig:
    role = WorkerConfig(
        worker_cls="roll.pipeline.base.rl_workers.ActorWorker",
        device_mapping="0-3",
        model_args=ModelArguments(model_name_or_path="tiny://qwen2", dtype="bf16"),
        strategy_args=StrategyArguments(strategy_name="deepspeed_train", strategy_config=block),
    )
    role.resolve("actor_train", 4)
    check_strategy_args(role)
    return role


def test_memory_estimate_splits_the_linear_layers_and_shards_zero_over_data_parallel_groups() -> None:
    block = yaml.safe_load((CONFIG_DIR / "deepspeed_zero2.yaml").read_text())["deepspeed_zero2"]
    plain = estimate_rank(tiny_train_role(block), prompt_length=4, response_length=4)
    split = estimate_rank(
        tiny_train_role(block | {"tensor_parallel": {"autotp_size": 2}}), prompt_length=4, response_length=4
    )
    assert plain is not None and split is not None and split.ranks == plain.ranks == 4

    def resident(estimate: Any, name: str) -> int:
        return next(item.nbytes for item in estimate.resident if item.name == name)

    # Tiny qwen2: 2 layers of linear weights (q, k, v, o, gate, up, down) split in half; embeddings, norms and
    # the LM head whole. ZeRO-2 shards Adam's states over 2 data-parallel groups instead of 4 ranks.
    linear = 2 * (128 * 128 + 128 + 2 * (128 * 64 + 64) + 128 * 128 + 3 * 128 * 256)
    plain_params = resident(plain, "params") // 2
    assert resident(split, "params") // 2 == plain_params - linear // 2
    assert resident(split, "Adam m+v") == 8 * -(-(plain_params - linear // 2) // 2)
    assert any("4 ranks = 2 data-parallel x 2 tensor-parallel" in note for note in split.notes)


def test_dry_run_plans_data_parallel_groups_of_tensor_parallel_ranks() -> None:
    autotp = "+actor_train.strategy_args.strategy_config.tensor_parallel.autotp_size=2"
    lines = report(
        "sft_arithmetic", "devices_per_node=2", autotp, "actor_train.training_args.gradient_accumulation_steps=2"
    )
    text = "\n".join(lines)
    assert "actor_train: 2 ranks = 1 data-parallel group(s) x 2 tensor-parallel ranks" in text
    assert "64 demonstrations per optimizer step = 1 rank(s) x micro-batches of 32 x 2 accumulation" in text
    assert "note: 2 ranks = 1 data-parallel x 2 tensor-parallel" in text
    with pytest.raises(ConfigError, match=r"batch_size=64 must equal .* dp size = 32"):
        report("sft_arithmetic", "devices_per_node=2", autotp)


def test_dry_run_plans_two_data_parallel_groups_of_two_tensor_parallel_ranks_on_four_slots() -> None:
    autotp = "+actor_train.strategy_args.strategy_config.tensor_parallel.autotp_size="
    four = ("devices_per_node=4", "actor_train.device_mapping=0-3")
    micro = "actor_train.training_args.per_device_train_batch_size=16"
    text = "\n".join(
        report("sft_arithmetic", *four, f"{autotp}2", micro, "actor_train.training_args.gradient_accumulation_steps=2")
    )
    assert "actor_train: 4 ranks = 2 data-parallel group(s) x 2 tensor-parallel ranks" in text
    assert "actor_train rank 3: node 0, devices [3]" in text
    assert "64 demonstrations per optimizer step = 2 rank(s) x micro-batches of 16 x 2 accumulation" in text
    assert "note: 4 ranks = 2 data-parallel x 2 tensor-parallel" in text
    with pytest.raises(
        ConfigError, match=r"tensor_parallel.autotp_size=3 does not divide actor_train's 4 rank\(s\); set"
    ):
        report("sft_arithmetic", *four, f"{autotp}3", micro)
