"""The dry run's estimate of a Reward FL actor: the fake-tensor census against the real forward's saved tensors,
each part's weights and the ZeRO states of the trained ones, and the printed plan."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from roll.configs.schema import ConfigError
from roll.configs.worker_config import ModelArguments
from roll.models.diffusion.parts import encode_prompts, load_diffusion_parts
from roll.pipeline.base.dry_run.plan import dry_run_report
from roll.pipeline.diffusion.memory_estimate import census_actor
from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig
from roll.pipeline.diffusion.reward_fl_model import RewardFLModel
from roll.rewards.image_rewards import build_image_reward
from tests.unit.test_hydra_configs import load_config

TINY = "tiny-diffusion://unet?image_size=8&base_channels=8&text_hidden_size=16"


def tiny_config(tmp_path: Path, *overrides: str) -> RewardFLConfig:
    return load_config(
        "reward_fl_shapes",
        [
            "platform=cpu",
            f"output_dir={tmp_path}",
            "warm_start.base_model=''",
            "warm_start.output_dir=''",
            f"pretrain='{TINY}'",
            "batch_size=4",
            "actor.training_args.per_device_train_batch_size=4",
            "data.held_out_prompts=2",
            "sampling.num_inference_steps=3",
            *overrides,
        ],
    )


def saved_storage_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves while `forward` runs, `model`'s parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(saved.values())


def real_saved_bytes(config: RewardFLConfig) -> int:
    """Distinct storages autograd saves in the real actor's forward, parameters left out."""
    parts = load_diffusion_parts(TINY)
    model = RewardFLModel(parts, build_image_reward("redness"), config.trainable_models, ModelArguments(), True)
    model.sampling = config.sampling
    return saved_storage_bytes(model, lambda: model(**encode_prompts(parts.tokenizer, ["a red circle"] * 4)))


def test_the_census_counts_what_the_real_forward_saves(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "trainable_models=[unet,text_encoder]")  # guidance 3, the last 2 steps
    census = census_actor(config)
    # Alone it agrees to 64 bytes (a few int64 indices); in the whole suite's process the real forward saved 4 KB
    # more of 3.9 MB (2026-11-28: a kernel choice another test's global state changes, not yet pinned down).
    assert census.activations == pytest.approx(real_saved_bytes(config), rel=0.005)
    real = load_diffusion_parts(TINY)
    unet, text = (sum(p.numel() for p in m.parameters()) for m in (real.unet, real.text_encoder))
    assert census.params == {"unet": unet, "text_encoder": text, "reference_unet": unet, "reference_text_encoder": text}
    assert census.trainable == unet + text


@pytest.mark.slow  # four censuses and a LoRA model: 15-45 s on 2 cores (fake-tensor dispatch, load 8-40)
def test_checkpointing_keeps_less_lora_and_policy_gradient_keep_no_reference_copy(tmp_path: Path) -> None:
    plain = census_actor(tiny_config(tmp_path, "sampling.grad_steps=3"))
    checkpointed = census_actor(
        tiny_config(tmp_path, "sampling.grad_steps=3", "actor.training_args.gradient_checkpointing=true")
    )
    assert 0 < checkpointed.activations < plain.activations
    lora = census_actor(
        tiny_config(tmp_path, "actor.model_args.lora_rank=4", "actor.model_args.lora_target_modules=[to_q,to_v]")
    )
    assert "reference_unet" not in lora.params and 0 < lora.trainable < lora.params["unet"] // 10
    adapted = RewardFLModel(
        load_diffusion_parts(TINY),
        build_image_reward("redness"),
        ["unet"],
        ModelArguments(lora_rank=4, lora_target_modules=["to_q", "to_v"]),
        True,
    )
    assert lora.params["unet lora"] == lora.trainable == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    policy_run = ("algorithm=policy_gradient", "regulariser_weight=0", "batch_size=1")
    policy = census_actor(tiny_config(tmp_path, *policy_run))
    # The update recomputes every step's pass with its gradient; policy gradient keeps no frozen copy.
    assert "reference_unet" not in policy.params and policy.activations > 0


def test_zero2_states_follow_the_trained_parts_and_the_dry_run_prints_them(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    resident, phases, _ = config.rank_breakdown("actor", config.actor, "cpu")
    items = {item.name: item.nbytes for item in resident}
    unet = sum(p.numel() for p in load_diffusion_parts(TINY).unet.parameters())
    assert items["unet params"] == items["reference_unet params"] == 4 * unet
    # ZeRO-2 on one rank, fp32: gradients, a cloned fp32 partition and Adam's two moments of the UNet alone.
    assert (items["grads"], items["fp32 master"], items["Adam m+v"]) == (4 * unet, 4 * unet, 8 * unet)
    assert [item.name for item in phases["train micro-batch"]] == ["activations", "buckets"]
    report = "\n".join(dry_run_report(config))  # the census above is reused
    assert "actor (deepspeed_train, 1 rank)" in report and "no memory estimate" not in report
    assert "unet params" in report and "actor/0: runtime" in report


FLOW_MODELS = {"reward_fl_flow_shapes": "tiny-diffusion://sd3", "reward_fl_flow_video": "tiny-diffusion://wan"}


@pytest.mark.parametrize("config_name", sorted(FLOW_MODELS))
def test_the_flow_census_counts_what_the_real_forward_saves(tmp_path: Path, config_name: str) -> None:
    """A flow model's census (built from its pipeline's configs, no weights) against the real tiny SD3 or Wan: the
    same parts and parameters, the same bytes saved for backward by a Reward FL forward."""
    from roll.models.diffusion.flow_parts import load_flow_parts
    from roll.pipeline.diffusion.flow_model import FlowRewardModel

    model_ref = FLOW_MODELS[config_name]
    overrides = ["platform=cpu", f"output_dir={tmp_path}", "warm_start.base_model=''", "warm_start.output_dir=''"]
    overrides += [f"pretrain='{model_ref}'", "batch_size=2", "actor.training_args.per_device_train_batch_size=2"]
    config = load_config(config_name, [*overrides, "data.held_out_prompts=2", "reward.name=redness"])
    census = census_actor(config)

    parts = load_flow_parts(model_ref)
    model = FlowRewardModel(parts, build_image_reward("redness"), ModelArguments(), with_reference=True)
    model.sampling, model.flow = config.sampling, config.flow
    input_ids = parts.pipeline.tokenizer(["a red circle"] * 2, return_tensors="pt")["input_ids"]
    real = saved_storage_bytes(model, lambda: model(input_ids))
    # Wan's agree within 1%; SD3's census counts 32 KB of 3.1 MB more than the real forward saves (1.06%, 2026-11-29:
    # not traced to its tensor).
    assert census.activations == pytest.approx(real, rel=0.02)
    counts = {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()}
    assert census.params == {name: count for name, count in counts.items() if count}
    assert census.trainable == counts["transformer"]


def test_lora_targets_that_match_no_layer_of_the_flow_transformer_are_a_config_error(tmp_path: Path) -> None:
    overrides = ["platform=cpu", f"output_dir={tmp_path}", "warm_start.base_model=''", "warm_start.output_dir=''"]
    overrides += ["pretrain='tiny-diffusion://sd3'", "actor.model_args.lora_rank=4"]
    config = load_config("reward_fl_flow_shapes", overrides)  # the default targets are a decoder's (q_proj, ...)
    with pytest.raises(ConfigError, match=r"actor\.model_args\.lora_target_modules=.*names no linear"):
        census_actor(config)
    fixed = load_config("reward_fl_flow_shapes", [*overrides, "actor.model_args.lora_target_modules=[to_q,to_v]"])
    census = census_actor(fixed)
    assert census.params["transformer lora"] > 0 and census.trainable == census.params["transformer lora"]
