"""Reward FL's config, rewards, data and warm start: every field's bad value is a one-line error naming it, a reward
without a gradient is refused with the policy-gradient option, and the warm start is reused."""

from __future__ import annotations

import copy
import random
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from roll.configs.hydra_defaults import dataclass_in
from roll.configs.loader import load_pipeline_config
from roll.configs.schema import ConfigError, field_rule
from roll.pipeline.diffusion.image_grid import image_grid
from roll.pipeline.diffusion.policy_gradient import PolicyGradientArguments
from roll.pipeline.diffusion.prompts import PromptDataArguments, load_prompts, prompt_splits
from roll.pipeline.diffusion.reward_fl_config import RewardArguments, RewardFLConfig
from roll.pipeline.diffusion.sampling import SamplingArguments
from roll.pipeline.diffusion.shapes import COLOURS, all_prompts, draw
from roll.pipeline.diffusion.warm_start import WarmStartArguments, run_warm_start, warm_start_done
from roll.rewards.image_rewards import BUILTIN_IMAGE_REWARDS, ImageReward, build_image_reward, image_reward_class
from tests.unit.test_config_validation import BLOCKS, assert_names_field, bad_value, init_fields, type_checks_it
from tests.unit.test_hydra_configs import compose_config

TINY = "tiny-diffusion://unet?image_size=8&base_channels=8&text_hidden_size=16"
OWN_SCHEMAS = (
    RewardFLConfig,
    SamplingArguments,
    RewardArguments,
    PromptDataArguments,
    WarmStartArguments,
    PolicyGradientArguments,
)


@pytest.fixture
def valid(tmp_path: Path) -> dict[str, Any]:
    """The example YAML, composed for this machine and resolved to plain data."""
    cfg = compose_config("reward_fl_shapes", ["platform=cpu", "devices_per_node=2", f"output_dir={tmp_path}"])
    data = OmegaConf.to_container(cfg, resolve=True)
    load_pipeline_config(copy.deepcopy(data), RewardFLConfig, BLOCKS)
    return data


def reward_fl(data: dict[str, Any], **changes: Any) -> RewardFLConfig:
    """`data` with dotted-path `changes` (`sampling__grad_steps=9`), converted and validated."""
    data = copy.deepcopy(data)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    return load_pipeline_config(data, RewardFLConfig, BLOCKS)


def own_field_cases() -> list[tuple[str, Any]]:
    """(dotted path, bad value) of every field Reward FL's schemas declare themselves (inherited ones are walked
    with the other pipelines in test_config_validation)."""
    cases = []

    def walk(schema: type, prefix: str) -> None:
        hints = typing.get_type_hints(schema)
        for f, tp in init_fields(schema):
            if schema is RewardFLConfig and f.name not in RewardFLConfig.__annotations__:
                continue
            nested = dataclass_in(hints[f.name])
            if nested in OWN_SCHEMAS:
                walk(nested, f"{prefix}{f.name}.")
                continue
            rule = field_rule(f)
            if (rule is None and type_checks_it(tp)) or (rule is not None and not rule.anything):
                cases.append((prefix + f.name, bad_value(tp, rule)))

    walk(RewardFLConfig, "")
    return cases


@pytest.mark.parametrize(("path", "bad"), own_field_cases(), ids=[path for path, _ in own_field_cases()])
def test_a_bad_value_of_every_reward_fl_field_is_a_one_line_error_naming_it(
    valid: dict[str, Any], path: str, bad: Any
) -> None:
    with pytest.raises(ConfigError) as error:
        reward_fl(valid, **{path.replace(".", "__"): bad})
    assert_names_field(str(error.value), path)


def test_a_reward_without_gradient_is_refused_with_the_policy_gradient_option(valid: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as error:
        reward_fl(valid, reward__name="compressibility")
    message = str(error.value)
    assert "reward.name='compressibility' is not differentiable" in message
    assert "algorithm=policy_gradient" in message
    policy = reward_fl(
        valid, reward__name="compressibility", algorithm="policy_gradient", regulariser_weight=0, batch_size=2
    )
    assert policy.policy.group_size == 4 and "2 prompts x 4 stochastic samples" in policy.batch_plan()[0]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"reward__name": "aesthetics"}, r"reward.name='aesthetics' is not a built-in image reward \(redness"),
        ({"reward__name": "roll.rewards.image_rewards.build_image_reward"}, "is not a subclass of .*ImageReward"),
        ({"sampling__grad_steps": 9}, "sampling.grad_steps=9 is more than sampling.num_inference_steps=8"),
        ({"sampling__min_timestep": 500, "sampling__max_timestep": 500}, "sampling.min_timestep=500 must be below"),
        (
            {"sampling__min_timestep": 100},  # the last of 8 DDIM steps is at timestep 0
            r"sampling.min_timestep=100 and sampling.max_timestep=1000 leave the last denoising step \(timestep 0",
        ),
        ({"actor__max_tokens_per_microbatch": 64}, "actor.max_tokens_per_microbatch=64 and .* must be null"),
        ({"actor__sequence_packing": True}, "actor.sequence_packing=True must be null and false"),
        ({"batch_size": 16}, "batch_size=16 must equal actor per_device_train_batch_size"),
        ({"warm_start__output_dir": "/tmp/elsewhere"}, "warm_start.output_dir='/tmp/elsewhere' must be actor"),
        ({"warm_start__base_model": "tiny-diffusion://unet?depth=3"}, "warm_start.base_model: .*unknown tiny"),
        ({"max_response_length": 9}, "max_response_length=9 does not apply to images"),
        ({"eval_batch_size": 16}, "eval_batch_size=16 does not apply to Reward FL"),
        (
            {"algorithm": "policy_gradient", "regulariser_weight": 0},
            r"batch_size=8 x policy.group_size=4 must equal actor per_device_train_batch_size",
        ),
        ({"algorithm": "policy_gradient", "batch_size": 2}, "regulariser_weight=1.0 applies to algorithm=reward_fl"),
        ({"data__held_out_prompts": 24}, "data.held_out_prompts=24 leaves none of the 24 prompts for training"),
        ({"data__held_out_prompts": 20}, "batch_size=8 is more than the 4 training prompts"),
        (
            {"trainable_models": ["text_encoder"], "actor__model_args__lora_rank": 4},
            r"lora_rank > 0 adapts the UNet \(or a flow model.s transformer\), which trainable_models does not list",
        ),
        (
            {"actor__strategy_args__strategy_name": "hf_infer", "actor__strategy_args__strategy_config": {}},
            "actor.strategy_args.strategy_name=hf_infer does not train",
        ),
    ],
)
def test_relations_between_fields_are_errors_naming_them(
    valid: dict[str, Any], changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        reward_fl(valid, **changes)


def test_a_window_that_ends_at_the_last_step_keeps_the_reward_gradient(valid: dict[str, Any]) -> None:
    # Of the 8 steps (875 ... 125, 0) the last 3 are 250, 125, 0: the window keeps 125 and 0, a suffix.
    config = reward_fl(valid, sampling__max_timestep=200, sampling__grad_steps=3)
    assert config.sampling.max_timestep == 200


def test_a_model_directory_without_its_parts_is_refused(valid: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "model" / "unet").mkdir(parents=True)
    with pytest.raises(ConfigError, match="is not a diffusers text-to-image directory: it has no scheduler, text_enc"):
        reward_fl(valid, warm_start__base_model="", actor__model_args__model_name_or_path=str(tmp_path / "model"))


def test_prompts_come_from_a_file_one_a_line(valid: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "prompts.txt").write_text("".join(f"  prompt {i}\n\n" for i in range(12)))
    assert load_prompts(str(tmp_path / "prompts.txt")) == [f"prompt {i}" for i in range(12)]
    assert reward_fl(valid, data__prompt_file=str(tmp_path / "prompts.txt"), data__held_out_prompts=4).data.prompt_file
    with pytest.raises(ConfigError, match="batch_size=8 is more than the 7 training prompts"):
        reward_fl(valid, data__prompt_file=str(tmp_path / "prompts.txt"), data__held_out_prompts=5)


def test_builtin_rewards_on_hand_made_images() -> None:
    colours = [(1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)]  # red, blue, white, black
    images = torch.tensor(colours).view(4, 3, 1, 1).expand(4, 3, 4, 4)
    prompts = [""] * 4
    assert build_image_reward("redness")(images, prompts).tolist() == [1, 0, 0, 0]
    assert build_image_reward("brightness")(images, prompts).tolist() == pytest.approx([0.299, 0.114, 1, 0])
    assert build_image_reward("colourfulness")(images, prompts).tolist() == [1, 1, 0, 0]
    compressibility = build_image_reward("compressibility")(images, prompts)
    assert compressibility.shape == (4,) and (compressibility < 0).all()
    assert [cls.differentiable for cls in BUILTIN_IMAGE_REWARDS.values()] == [True, True, True, False]
    assert issubclass(image_reward_class("roll.rewards.image_rewards.Redness"), ImageReward)


def test_prompt_splits_are_disjoint_and_images_have_the_prompted_colour() -> None:
    train, held_out = prompt_splits(all_prompts(), 6)
    assert len(held_out) == 6 and not set(train) & set(held_out) and sorted(train + held_out) == sorted(all_prompts())
    image = draw("a blue square", 16, random.Random(0))
    inside = image.abs().sum(0) > 0
    assert 0 < inside.float().mean() < 1
    assert torch.allclose(image[:, inside], torch.tensor(COLOURS["blue"]).view(3, 1).expand(3, int(inside.sum())))
    with pytest.raises(ValueError, match="held_out=24 must be between 1 and 23"):
        prompt_splits(all_prompts(), 24)


def test_image_grid_lays_out_rows_of_enlarged_images() -> None:
    grid = image_grid(torch.ones(5, 3, 2, 2), columns=2, scale=3, gap=1)
    assert grid.shape == (3 * 7 + 1, 2 * 7 + 1, 3)
    assert grid[1:7, 1:7].eq(1).all() and grid[0].eq(0.5).all()


def test_warm_start_runs_once_and_is_reused(tmp_path: Path) -> None:
    args = WarmStartArguments(base_model=TINY, output_dir=str(tmp_path / "warm"), steps=2, batch_size=2)
    assert not warm_start_done(args)
    first = run_warm_start(args)
    assert warm_start_done(args) and first["warm_start_s"] > 0
    weights = tmp_path / "warm" / "unet" / "diffusion_pytorch_model.safetensors"
    written = weights.stat().st_mtime_ns
    assert run_warm_start(args) == first and weights.stat().st_mtime_ns == written
    assert not warm_start_done(WarmStartArguments(**{**args.__dict__, "steps": 3}))
