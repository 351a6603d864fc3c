"""The DeepSpeed config of a role: `auto` filling and the errors for conflicting values (no DeepSpeed import)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import yaml

from roll.configs.schema import ConfigError, from_dict
from roll.configs.worker_config import ModelArguments, StrategyArguments, TrainingArguments, WorkerConfig
from roll.distributed.strategy.deepspeed_config import resolve_deepspeed_config
from roll.distributed.strategy.lr_schedule import lr_lambda
from roll.distributed.strategy.registry import check_strategy_args
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
from roll.platforms import current_platform
from tests.conftest import CONFIG_DIR

ZERO2 = yaml.safe_load((CONFIG_DIR / "deepspeed_zero2.yaml").read_text())["deepspeed_zero2"]
ZERO3 = yaml.safe_load((CONFIG_DIR / "deepspeed_zero3.yaml").read_text())["deepspeed_zero3"]


def role(
    block: dict, strategy: str = "deepspeed_train", devices: str = "0-1", dtype: str = "bf16", **training: object
) -> WorkerConfig:
    config = WorkerConfig(
        worker_cls="w.W",
        device_mapping=devices,
        model_args=ModelArguments(dtype=dtype),
        strategy_args=StrategyArguments(strategy_name=strategy, strategy_config=copy.deepcopy(block)),
        training_args=TrainingArguments(per_device_train_batch_size=2, gradient_accumulation_steps=3, **training),
    )
    config.resolve("actor_train", 4)
    check_strategy_args(config)
    return config


def test_auto_fields_come_from_the_role() -> None:
    resolved = resolve_deepspeed_config(role(ZERO2, max_grad_norm=0.5), training=True)
    assert resolved["train_micro_batch_size_per_gpu"] == 2 and resolved["gradient_accumulation_steps"] == 3
    assert resolved["train_batch_size"] == 2 * 3 * 2 and resolved["gradient_clipping"] == 0.5
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"]["enabled"] is False
    assert ZERO2["train_batch_size"] == "auto"  # the block itself is not modified


def test_batch_size_that_does_not_multiply_out_is_an_error() -> None:
    block = ZERO2 | {"train_batch_size": 8}
    with pytest.raises(
        ConfigError, match=r"train_batch_size=8 must equal micro batch 2 x accumulation 3 x data-parallel"
    ):
        role(block)


def test_explicit_value_disagreeing_with_training_args_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=4 disagrees with actor_train.training_args"):
        role(ZERO2 | {"train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match=r"bf16.enabled=False disagrees with actor_train.model_args.dtype=bf16"):
        role(ZERO2 | {"bf16": {"enabled": False}})


def test_parameter_offload_needs_stage_3() -> None:
    block = copy.deepcopy(ZERO2)
    block["zero_optimization"]["offload_param"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match=r"offload_param needs ZeRO stage 3, not 2"):
        role(block)


def test_nvme_offload_needs_a_path() -> None:
    block = copy.deepcopy(ZERO3)
    block["zero_optimization"]["offload_optimizer"] = {"device": "nvme"}
    with pytest.raises(ConfigError, match=r"offload_optimizer.nvme_path must name a directory"):
        role(block)


def test_deepspeed_infer_needs_stage_3() -> None:
    with pytest.raises(ConfigError, match=r"deepspeed_infer needs ZeRO stage 3 \(got 2\)"):
        role(ZERO2, strategy="deepspeed_infer")
    assert resolve_deepspeed_config(role(ZERO3, strategy="deepspeed_infer"), training=False)["train_batch_size"] == 2


def test_decaying_schedule_needs_max_steps() -> None:
    with pytest.raises(ConfigError, match=r"lr_scheduler_type=cosine needs actor_train.training_args.max_steps"):
        role(ZERO2, lr_scheduler_type="cosine")


def test_lr_schedules() -> None:
    warm_linear = lr_lambda(TrainingArguments(warmup_steps=2, lr_scheduler_type="linear", max_steps=6))
    assert [warm_linear(s) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    cosine = lr_lambda(TrainingArguments(lr_scheduler_type="cosine", max_steps=4))
    assert [cosine(s) for s in (0, 2, 4, 9)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert lr_lambda(TrainingArguments())(100) == 1.0


@pytest.fixture
def cpu_without_fp16(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The run's platform is the CPU, and oneDNN reports no fp16 kernels (as on AMD EPYC)."""
    monkeypatch.setenv("ROLL_PLATFORM", "cpu")
    monkeypatch.setattr("roll.platforms.cpu.onednn_supports_fp16", lambda: False)
    current_platform.cache_clear()
    yield
    current_platform.cache_clear()


@pytest.mark.parametrize("strategy", ["deepspeed_train", "deepspeed_infer"])
def test_fp16_on_a_cpu_without_fp16_is_an_error_suggesting_bf16(cpu_without_fp16: None, strategy: str) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^actor_train.model_args.dtype=fp16 is not supported on this CPU \(.*oneDNN finds no fp16 support.*\); "
        r"use bf16 or fp32$",
    ):
        role(ZERO3, strategy=strategy, dtype="fp16")
    role(ZERO3, strategy=strategy, dtype="bf16")


def test_block_enabling_fp16_is_checked_too(cpu_without_fp16: None) -> None:
    with pytest.raises(ConfigError, match=r"dtype=fp16 is not supported on this CPU"):
        role(ZERO2 | {"fp16": {"enabled": True, "loss_scale": 0}}, dtype="fp16")


def test_fp16_passes_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch, cpu_without_fp16: None) -> None:
    monkeypatch.setattr("roll.platforms.cpu.onednn_supports_fp16", lambda: True)
    assert resolve_deepspeed_config(role(ZERO2, dtype="fp16"), training=True)["fp16"]["enabled"] is True


def test_cpu_features_are_not_checked_for_a_gpu_run(monkeypatch: pytest.MonkeyPatch, cpu_without_fp16: None) -> None:
    monkeypatch.setenv("ROLL_PLATFORM", "cuda")
    current_platform.cache_clear()
    assert resolve_deepspeed_config(role(ZERO2, dtype="fp16"), training=True)["fp16"]["enabled"] is True


def test_the_configured_platform_decides_which_checks_run(
    monkeypatch: pytest.MonkeyPatch, cpu_without_fp16: None
) -> None:
    """platform=cpu in the config checks the CPU's fp16 even where the environment names another platform."""
    monkeypatch.setenv("ROLL_PLATFORM", "cuda")
    current_platform.cache_clear()
    data = {
        "platform": "cpu",
        "devices_per_node": 2,
        "actor_train": {
            "worker_cls": "roll.pipeline.cluster_check.cluster_check_worker.ClusterCheckWorker",
            "device_mapping": "0-1",
            "model_args": {"dtype": "fp16"},
            "strategy_args": {"strategy_name": "deepspeed_train", "strategy_config": copy.deepcopy(ZERO2)},
            "training_args": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        },
    }
    with pytest.raises(ConfigError, match=r"dtype=fp16 is not supported on this CPU"):
        from_dict(ClusterCheckConfig, data).validate()


def autotp(size: object, **extra: object) -> dict:
    """The ZeRO-2 block with a DeepSpeed AutoTP block."""
    return ZERO2 | {"tensor_parallel": {"autotp_size": size, **extra}}


def test_autotp_groups_ranks_into_data_parallel_groups() -> None:
    actor = role(autotp(2), devices="0-3")
    assert actor.model_parallel_size == 2 and actor.dp_size == 2
    resolved = resolve_deepspeed_config(actor, training=True)
    assert resolved["train_batch_size"] == 2 * 3 * 2  # micro x accumulation x (4 ranks / tp 2)
    assert resolved["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert role(autotp(1), devices="0-3").dp_size == 4 and role(autotp(0), devices="0-3").dp_size == 4


def test_autotp_batch_size_counts_data_parallel_groups_not_ranks() -> None:
    with pytest.raises(ConfigError, match=r"data-parallel size 1 \(ranks / tensor_parallel.autotp_size 2\) = 6"):
        role(autotp(2) | {"train_batch_size": 12})


@pytest.mark.parametrize(
    ("tensor_parallel", "message"),
    [
        ({"autotp_size": 3}, r"tensor_parallel.autotp_size=3 does not divide actor_train's 2 rank\(s\); set it to a"),
        ({"autotp_size": -1}, r"tensor_parallel.autotp_size=-1 must be a whole number of ranks"),
        ({"autotp_size": "2"}, r"tensor_parallel.autotp_size='2' must be a whole number of ranks"),
        ({"autotp_size": True}, r"tensor_parallel.autotp_size=True must be a whole number of ranks"),
        ({"autotp_sise": 2}, r"tensor_parallel.autotp_sise is not a tensor_parallel key .*did you mean 'autotp_size'"),
        (
            {"autotp_size": 2, "vocab_parallel_lm_head": True},
            r"tensor_parallel.vocab_parallel_lm_head=True: roll's losses need full",
        ),
    ],
)
def test_bad_autotp_block_is_an_error_naming_the_field(tensor_parallel: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=r"actor_train.strategy_args.strategy_config." + message):
        role(ZERO2 | {"tensor_parallel": tensor_parallel})


def test_autotp_block_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"strategy_config.tensor_parallel=2 must be a mapping such as"):
        role(ZERO2 | {"tensor_parallel": 2})


def test_autotp_is_refused_for_inference_and_lora() -> None:
    with pytest.raises(ConfigError, match=r"autotp_size=2: AutoTP is a deepspeed_train option in roll"):
        role(ZERO3 | {"tensor_parallel": {"autotp_size": 2}}, strategy="deepspeed_infer")
    lora = WorkerConfig(
        worker_cls="w.W",
        device_mapping="0-1",
        model_args=ModelArguments(lora_rank=8),
        strategy_args=StrategyArguments(strategy_name="deepspeed_train", strategy_config=autotp(2)),
    )
    lora.resolve("actor_train", 2)
    with pytest.raises(ConfigError, match=r"autotp_size=2 with actor_train.model_args.lora_rank=8: AutoTP does not"):
        check_strategy_args(lora)


@pytest.mark.parametrize("stage_block", [ZERO2, ZERO3, ZERO2 | {"zero_optimization": {"stage": 0}}])
def test_autotp_combines_with_every_zero_stage(stage_block: dict) -> None:
    assert role(stage_block | {"tensor_parallel": {"autotp_size": 2}}).dp_size == 1


def test_nvme_offload_without_deepspeeds_async_io_op_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    block = copy.deepcopy(ZERO3)
    block["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/tmp/roll-nvme"}
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(ConfigError, match=r"offload_param\.device=nvme \(ZeRO-Infinity\) cannot run: .*libaio-dev"):
        role(block)
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: True)
    role(block)  # with the op it validates
