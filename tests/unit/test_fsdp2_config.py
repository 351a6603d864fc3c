"""The fsdp2_train and fsdp2_infer block: the example YAML blocks pass, and each bad input is a ConfigError naming its
field before Ray (no process group, no model)."""

from __future__ import annotations

import copy

import pytest
import torch.distributed.fsdp
import yaml

from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.configs.worker_config import ModelArguments, StrategyArguments, TrainingArguments, WorkerConfig
from roll.distributed.strategy.fsdp2_strategy import parse_fsdp2_config
from roll.distributed.strategy.registry import check_strategy_args, strategy_class
from roll.pipeline.base.dry_run.rank_estimate import estimate_rank
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
from roll.platforms import cpu
from tests.conftest import CONFIG_DIR, REPO_ROOT
from tests.unit.test_hydra_configs import compose_config

BLOCKS = {
    name: yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())[name] for name in ("fsdp2", "fsdp2_cpuoffload")
}


def role(
    block: dict,
    devices: str = "0-1",
    dtype: str = "fp32",
    strategy: str = "fsdp2_train",
    name: str = "actor_train",
    training: TrainingArguments | None = None,
    **model: object,
) -> WorkerConfig:
    """A role on `devices` with `block` as its `strategy` config, checked as the pipeline checks it before Ray."""
    config = WorkerConfig(
        worker_cls="w.W",
        device_mapping=devices,
        model_args=ModelArguments(dtype=dtype, **model),
        strategy_args=StrategyArguments(strategy_name=strategy, strategy_config=copy.deepcopy(block)),
        training_args=training or TrainingArguments(),
    )
    config.resolve(name, 4)
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


BAD_BLOCKS = [
    ({"zero_optimization": {"stage": 3}}, r"strategy_config.zero_optimization is a DeepSpeed key, not an FSDP2"),
    ({"gradient_clipping": 1.0}, r"strategy_config.gradient_clipping is a DeepSpeed key.*max_grad_norm"),
    ({"shard_size": 3}, r"strategy_config.shard_size=3 does not divide actor_train's 2 rank"),
    ({"reshard_after_froward": True}, r"reshard_after_froward.*did you mean 'reshard_after_forward'"),
    ({"param_dtype": "fp16"}, r"strategy_config.param_dtype"),
]


@pytest.mark.parametrize(("change", "message"), BAD_BLOCKS)
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


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_fsdp2_infer_takes_the_same_blocks_and_refuses_the_same_bad_ones(name: str) -> None:
    """A reference on either example block passes; each bad block fsdp2_train refuses is refused for it too."""
    assert not strategy_class("fsdp2_infer").trains()
    reference = role(BLOCKS[name], strategy="fsdp2_infer", name="reference")
    assert parse_fsdp2_config(reference, "fsdp2_infer") == parse_fsdp2_config(role(BLOCKS[name]))
    assert reference.dp_size == 2
    for change, message in BAD_BLOCKS:
        with pytest.raises(ConfigError, match=message.replace("actor_train", "reference")):
            role(BLOCKS[name] | change, strategy="fsdp2_infer", name="reference")


def test_fsdp2_infer_checks_precision_and_torch_but_not_what_only_training_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No loss scaler or LR schedule to check for a frozen model; the precision and the torch in use still are."""
    decaying = TrainingArguments(lr_scheduler_type="cosine", max_steps=0)
    with pytest.raises(ConfigError, match=r"actor_train.training_args.lr_scheduler_type=cosine needs"):
        role(BLOCKS["fsdp2"], training=decaying)
    role(BLOCKS["fsdp2"], strategy="fsdp2_infer", name="reference", training=decaying)
    monkeypatch.setattr(cpu.CpuPlatform, "dtype_unsupported_reason", lambda self, dtype: "")
    role(BLOCKS["fsdp2"], strategy="fsdp2_infer", name="reference", dtype="fp16")  # no loss scaler needed
    monkeypatch.setattr(cpu.CpuPlatform, "dtype_unsupported_reason", lambda self, dtype: f"no {dtype} here")
    with pytest.raises(ConfigError, match=r"reference.model_args.dtype=fp16 is not supported on this CPU"):
        role(BLOCKS["fsdp2"], strategy="fsdp2_infer", name="reference", dtype="fp16")
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    with pytest.raises(ConfigError, match=r"reference.strategy_args.strategy_name=fsdp2_infer: torch .* has no"):
        role(BLOCKS["fsdp2"], strategy="fsdp2_infer", name="reference")


def test_what_a_frozen_fsdp2_infer_model_cannot_do_is_refused() -> None:
    """Without a backward pass nothing would reshard a layer kept gathered; LoRA would rename the synced weights."""
    kept = BLOCKS["fsdp2"] | {"reshard_after_forward": False}
    role(kept)  # training reshards in backward
    with pytest.raises(ConfigError, match=r"reference.strategy_args.strategy_config.reshard_after_forward=false"):
        role(kept, strategy="fsdp2_infer", name="reference")
    with pytest.raises(ConfigError, match=r"reference.model_args.lora_rank=8: fsdp2_infer serves a frozen model"):
        role(BLOCKS["fsdp2"], strategy="fsdp2_infer", name="reference", lora_rank=8)


def test_dry_run_counts_an_fsdp2_infer_rank_as_deepspeed_infer_at_zero3() -> None:
    """Its parameters are split over the ranks as ZeRO-3 splits them, in host memory under `cpu_offload`."""
    zero3 = yaml.safe_load((CONFIG_DIR / "deepspeed_zero3.yaml").read_text())["deepspeed_zero3"]
    estimates = {
        (strategy, block_name): estimate_rank(
            role(block, strategy=strategy, name="reference", model_name_or_path="tiny://qwen2"),
            prompt_length=6,
            response_length=10,
        )
        for strategy, block_name, block in (
            ("deepspeed_infer", "deepspeed_zero3", zero3),
            ("fsdp2_infer", "fsdp2", BLOCKS["fsdp2"]),
            ("fsdp2_infer", "fsdp2_cpuoffload", BLOCKS["fsdp2_cpuoffload"]),
        )
    }
    params = {key: [(i.nbytes, i.place) for i in e.resident if i.name == "params"] for key, e in estimates.items()}
    zero3_params = params[("deepspeed_infer", "deepspeed_zero3")]
    assert params[("fsdp2_infer", "fsdp2")] == zero3_params and zero3_params[0][1] == "device"
    assert params[("fsdp2_infer", "fsdp2_cpuoffload")] == [(zero3_params[0][0], "host")]
    assert "fsdp2_infer counted as ZeRO-3" in estimates[("fsdp2_infer", "fsdp2")].notes[0]


def test_dry_run_counts_fsdp2_train_shards_in_fp32_whatever_the_compute_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """fsdp2_train keeps every shard in fp32 (a LoRA's frozen base too), with no second master copy, and steps them
    with torch's AdamW."""
    monkeypatch.setattr(cpu.CpuPlatform, "dtype_unsupported_reason", lambda self, dtype: "")

    def params(dtype: str, lora_rank: int = 0) -> int:
        trained = role(BLOCKS["fsdp2"], dtype=dtype, model_name_or_path="tiny://qwen2", lora_rank=lora_rank)
        estimate = estimate_rank(trained, prompt_length=6, response_length=10)
        assert not any(item.name == "fp32 master" for item in estimate.resident)
        # torch's AdamW steps the fp32 shards in place, one at a time on the host: no gradient copy, and two
        # temporaries of one shard (far below the rank's 2 x params of DeepSpeed's flat partition).
        step = estimate.phases["optimizer step"]
        params = next(item.nbytes for item in estimate.resident if item.name == "params")
        assert [item.name for item in step] == ["AdamW temporaries"] and step[0].nbytes < params
        return params

    assert params("bf16") == params("fp32")
    assert params("bf16", lora_rank=8) == params("fp32", lora_rank=8) > params("fp32")  # base and adapters, at 4 bytes
