"""The fsdp2_train block: the example YAML blocks pass, and each bad input is a ConfigError naming its field before
Ray (no process group, no model)."""

from __future__ import annotations

import copy

import pytest
import torch.distributed.fsdp
import yaml

from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.configs.worker_config import ModelArguments, StrategyArguments, WorkerConfig
from roll.distributed.strategy.fsdp2_strategy import parse_fsdp2_config
from roll.distributed.strategy.registry import check_strategy_args
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
from roll.platforms import cpu
from tests.conftest import CONFIG_DIR, REPO_ROOT
from tests.unit.test_hydra_configs import compose_config

BLOCKS = {
    name: yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())[name] for name in ("fsdp2", "fsdp2_cpuoffload")
}


def role(block: dict, devices: str = "0-1", dtype: str = "fp32", **model: object) -> WorkerConfig:
    config = WorkerConfig(
        worker_cls="w.W",
        device_mapping=devices,
        model_args=ModelArguments(dtype=dtype, **model),
        strategy_args=StrategyArguments(strategy_name="fsdp2_train", strategy_config=copy.deepcopy(block)),
    )
    config.resolve("actor_train", 4)
    check_strategy_args(config)
    return config


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_example_blocks_compose_into_a_pipeline_and_pass(name: str) -> None:
    overrides = [
        "platform=cpu",
        "devices_per_node=2",
        "actor_infer=null",
        "actor_train.strategy_args.strategy_name=fsdp2_train",
        f"actor_train.strategy_args.strategy_config=${{{name}}}",
    ]
    cfg = compose_config("all_deepspeed_blocks", overrides, config_dir=REPO_ROOT / "tests" / "configs")
    config = load_pipeline_config(cfg, ClusterCheckConfig, yaml_names([CONFIG_DIR]))
    assert config.actor_train.strategy_args.strategy_config == BLOCKS[name]
    assert parse_fsdp2_config(config.actor_train).cpu_offload is name.endswith("cpuoffload")
    assert config.actor_train.dp_size == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"zero_optimization": {"stage": 3}}, r"strategy_config.zero_optimization is a DeepSpeed key, not an FSDP2"),
        ({"gradient_clipping": 1.0}, r"strategy_config.gradient_clipping is a DeepSpeed key.*max_grad_norm"),
        ({"shard_size": 3}, r"strategy_config.shard_size=3 does not divide actor_train's 2 rank"),
        ({"reshard_after_froward": True}, r"reshard_after_froward.*did you mean 'reshard_after_forward'"),
        ({"param_dtype": "fp16"}, r"strategy_config.param_dtype"),
    ],
)
def test_bad_block_names_the_field(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        role(BLOCKS["fsdp2"] | change)


def test_replicate_by_shard_mesh_divides_the_ranks() -> None:
    assert parse_fsdp2_config(role(BLOCKS["fsdp2"] | {"shard_size": 2}, devices="0-3")).shard_size == 2


def test_option_this_torch_lacks_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    role(BLOCKS["fsdp2_cpuoffload"])
    monkeypatch.delattr(torch.distributed.fsdp, "CPUOffloadPolicy")
    role(BLOCKS["fsdp2"])  # the plain block does not need it
    with pytest.raises(ConfigError, match=r"strategy_config.cpu_offload: torch .* has no .*CPUOffloadPolicy"):
        role(BLOCKS["fsdp2_cpuoffload"])


def test_precision_is_detected_not_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu.CpuPlatform, "dtype_unsupported_reason", lambda self, dtype: f"no {dtype} here")
    role(BLOCKS["fsdp2"])  # fp32 needs nothing
    with pytest.raises(ConfigError, match=r"actor_train.model_args.dtype=bf16 is not supported on this CPU"):
        role(BLOCKS["fsdp2"], dtype="bf16")
    with pytest.raises(ConfigError, match=r"strategy_config.param_dtype=bf16 is not supported on this CPU"):
        role(BLOCKS["fsdp2"] | {"param_dtype": "bf16"})


def test_what_fsdp2_train_does_not_do_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model_args.dtype=fp16: fsdp2_train has no loss scaler; use bf16"):
        role(BLOCKS["fsdp2"], dtype="fp16")


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_lora_validates_and_bad_input_beside_it_is_still_named(name: str) -> None:
    assert parse_fsdp2_config(role(BLOCKS[name], lora_rank=8)) == parse_fsdp2_config(role(BLOCKS[name]))
    with pytest.raises(ConfigError, match=r"model_args.dtype=fp16: fsdp2_train has no loss scaler"):
        role(BLOCKS[name], dtype="fp16", lora_rank=8)
    with pytest.raises(ConfigError, match=r"strategy_config.shard_size=3 does not divide actor_train's 2 rank"):
        role(BLOCKS[name] | {"shard_size": 3}, lora_rank=8)
