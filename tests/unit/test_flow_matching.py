"""Flow-matching models: the Euler step, Flow-GRPO's SDE step and log-probability and DiffusionNFT's loss by hand,
the gradient through exactly the last K steps of the window, the tiny SD3 / Wan models through diffusers (their text
encoders loaded in the order of their names, whatever the process's string hashes), and the config errors of the
flow algorithms."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from roll.configs.schema import ConfigError
from roll.configs.worker_config import ModelArguments
from roll.models.diffusion.flow_parts import flow_family, load_flow_parts
from roll.models.diffusion.parts import encode_prompts
from roll.pipeline.diffusion.flow_config import FlowArguments
from roll.pipeline.diffusion.flow_model import FlowRewardModel
from roll.pipeline.diffusion.flow_sampling import (
    denoise_flow,
    euler_step,
    flow_sigmas,
    kept_steps,
    nft_loss,
    nft_optimality,
    sample_sde_trajectory,
    sde_gaussian,
    sde_step_log_probs,
)
from roll.pipeline.diffusion.sampling import SamplingArguments
from roll.rewards.image_rewards import build_image_reward
from tests.conftest import REPO_ROOT
from tests.unit.test_hydra_configs import load_config

TINY_SD3 = "tiny-diffusion://sd3?image_size=8&layers=1&head_dim=8&text_hidden_size=8"
TINY_WAN = "tiny-diffusion://wan?image_size=8&frames=3&layers=1&head_dim=8&text_hidden_size=8"


class TwoSteps:
    """A scheduler of two Euler steps, sigma 1 -> 0.5 -> 0 (timesteps 1000 and 500)."""

    config = SimpleNamespace(num_train_timesteps=1000)

    def set_timesteps(self, steps: int) -> None:
        assert steps == 2
        self.sigmas = torch.tensor([1.0, 0.5, 0.0])


def linear_velocity(weight: torch.Tensor, calls: list[bool]) -> Any:
    """v = weight x sample; records whether each call builds a graph."""

    def predict(sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return weight * sample

    return predict


def test_euler_step_is_diffusers_flow_match_step() -> None:
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sigmas = flow_sigmas(scheduler, 4)
    sample, velocity = torch.randn(2, 3), torch.randn(2, 3)
    expected = scheduler.step(velocity, scheduler.timesteps[1], sample).prev_sample
    assert torch.allclose(euler_step(sample, velocity, sigmas[1].item(), sigmas[2].item()), expected)


@pytest.mark.parametrize(
    ("grad_steps", "window", "gradient"),
    [
        (2, (0, 1000), -1.5),  # d/dw of x0 (1 - w/2)^2 at x0 = 2, w = 0.5
        (1, (0, 1000), -0.75),  # the last step only: -x1 / 2 with x1 = x0 (1 - w/2)
        (1, (900, 1000), -1.0),  # the first step only; the last one's velocity a constant: -x0 / 2
    ],
)
def test_the_gradient_reaches_exactly_the_last_k_steps_in_the_window(
    grad_steps: int, window: tuple[int, int], gradient: float
) -> None:
    weight = torch.tensor(0.5, requires_grad=True)
    calls: list[bool] = []
    args = SamplingArguments(
        num_inference_steps=2, grad_steps=grad_steps, min_timestep=window[0], max_timestep=window[1]
    )
    final = denoise_flow(linear_velocity(weight, calls), TwoSteps(), torch.tensor([2.0]), args)
    final.sum().backward()
    assert weight.grad.item() == pytest.approx(gradient)
    assert sum(calls) == grad_steps  # only the kept steps' velocities build a graph
    assert final.item() == pytest.approx(2 * 0.75**2)


def test_kept_steps_are_the_last_k_inside_the_window() -> None:
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert kept_steps(sigmas, SamplingArguments(grad_steps=2), 1000) == [False, False, True, True]
    window = SamplingArguments(grad_steps=2, min_timestep=400, max_timestep=800)
    assert kept_steps(sigmas, window, 1000) == [False, True, True, False]
    assert kept_steps(sigmas, SamplingArguments(grad_steps=2, min_timestep=900), 1000) == [True, False, False, False]


def test_sde_step_and_its_log_probability_on_two_steps_by_hand() -> None:
    x, v = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 1.0]])
    # sigma 1 -> 0.5 at noise level 0.5: g = 0.5 sqrt(1 / (1 - 0.5)) (the cap 0.5 at sigma 1), g^2 / (2 sigma) = 0.25
    mean, std = sde_gaussian(x, v, 1.0, 0.5, 0.5, 0.5)
    assert torch.allclose(mean, 0.875 * x - 0.5 * v) and std == pytest.approx(0.5)
    # sigma 0.5 -> 0: g = 0.5, g^2 / (2 sigma) = 0.25, the velocity's factor 1 + 0.25 x 0.5
    mean, std = sde_gaussian(x, v, 0.5, 0.0, 0.5, 0.5)
    assert torch.allclose(mean, 0.875 * x - 0.5625 * v) and std == pytest.approx(0.5 * math.sqrt(0.5))
    # Noise level 0 is the Euler step.
    mean, std = sde_gaussian(x, v, 0.5, 0.0, 0.0, 0.5)
    assert torch.allclose(mean, euler_step(x, v, 0.5, 0.0)) and std == 0

    weight = torch.tensor(0.5)
    torch.manual_seed(0)
    trajectory = sample_sde_trajectory(linear_velocity(weight, []), TwoSteps(), x, 2, 0.5)
    latents = trajectory.latents[0]
    first_mean, second_mean = 0.875 * latents[0] - 0.5 * 0.5 * latents[0], (0.875 - 0.5625 * 0.5) * latents[1]
    by_hand = [
        (-((latents[1] - first_mean) ** 2) / (2 * 0.5**2) - math.log(0.5) - 0.5 * math.log(2 * math.pi)).mean(),
        (
            -((latents[2] - second_mean) ** 2) / (2 * 0.125) - math.log(math.sqrt(0.125)) - 0.5 * math.log(2 * math.pi)
        ).mean(),
    ]
    assert trajectory.log_probs[0].tolist() == pytest.approx([t.item() for t in by_hand], rel=1e-5)
    assert trajectory.timesteps.tolist() == [1.0, 0.5] and trajectory.step_mask.tolist() == [True, True]
    # diffusers' two steps end at sigma 0.001 -> 0, whose noise (std ~7e-4) is too small for a stable ratio: masked.
    last_step_masked = sample_sde_trajectory(linear_velocity(weight, []), FlowMatchEulerDiscreteScheduler(), x, 2, 0.7)
    assert last_step_masked.step_mask.tolist() == [True, False]
    # The update recomputes them from the recorded samples: ratio 1 before any change.
    recomputed = sde_step_log_probs(
        linear_velocity(weight, []), TwoSteps(), trajectory.latents, trajectory.timesteps, 0.5
    )
    assert torch.allclose(recomputed, trajectory.log_probs)


def test_nft_loss_on_a_fixed_batch_by_hand() -> None:
    velocity = torch.tensor([[1.0], [2.0]], requires_grad=True)
    old, target, optimality = torch.tensor([[0.5], [2.0]]), torch.tensor([[0.0], [1.0]]), torch.tensor([1.0, 0.25])
    loss = nft_loss(velocity, old, target, optimality, beta=1.0)
    # Row 0: v+ = 0.5 + 0.5 = 1, v- = 0.5 - 0.5 = 0, so 1 x 1^2 + 0 x 0^2. Row 1: v+ = v- = 2, 0.25 x 1 + 0.75 x 1.
    assert loss.tolist() == pytest.approx([1.0, 1.0])
    loss.sum().backward()
    # d/dv: 2 r beta (v+ - t) - 2 (1 - r) beta (v- - t): row 0 2 x 1 - 0, row 1 2 x 0.25 - 2 x 0.75.
    assert velocity.grad.flatten().tolist() == pytest.approx([2.0, -1.0])
    assert nft_optimality(torch.tensor([-2.0, -0.5, 0.0, 3.0]), 1.0).tolist() == [0.0, 0.25, 0.5, 1.0]


@pytest.mark.parametrize(
    ("model", "family", "flow"),
    [(TINY_SD3, "image", FlowArguments()), (TINY_WAN, "video", FlowArguments(image_size=8, frames=3))],
)
def test_tiny_flow_models_train_their_transformer_only_and_export(
    model: str, family: str, flow: FlowArguments, tmp_path: Any
) -> None:
    parts = load_flow_parts(model)
    assert flow_family(model) == parts.family == family
    flow_model = FlowRewardModel(parts, build_image_reward("redness", {}), ModelArguments(), with_reference=True)
    flow_model.sampling = SamplingArguments(num_inference_steps=3, grad_steps=2, guidance_scale=2.0)
    flow_model.flow = flow
    ids = encode_prompts(parts.pipeline.tokenizer, ["a red circle", "a blue square"])["input_ids"]
    flow_model.train()  # as the engine sets it: the frozen encoders (T5's dropout) stay in eval mode
    assert flow_model.transformer.training and not any(m.training for m in flow_model.text_encoders.modules())
    output = flow_model(ids)
    assert output.images.shape == ((2, 3, 8, 8) if family == "image" else (2, 3, 3, 8, 8))  # video: [B, F, 3, H, W]
    (-output.rewards + output.regulariser).mean().backward()
    assert all(p.grad is not None for p in flow_model.transformer.parameters() if p.requires_grad)
    frozen = [flow_model.reference_transformer, flow_model.vae, flow_model.text_encoders]
    assert all(p.grad is None for module in frozen for p in module.parameters())
    if family == "video":  # the image reward's video rule: the mean of the frames' rewards
        per_frame = build_image_reward("redness", {})(output.images.flatten(0, 1), [""] * 6).view(2, 3)
        assert torch.allclose(output.rewards, per_frame.mean(dim=1))
    flow_model.save_pretrained(str(tmp_path), dict(flow_model.state_dict()))
    exported = load_flow_parts(str(tmp_path)).transformer.state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in parts.transformer.state_dict().items())


# Prints the component names of the transformers models `load_flow_parts(argv[1])` loads, in the order it loads them.
LOADING_ORDER = """
import json, sys
from pathlib import Path

import transformers

from roll.models.diffusion.flow_parts import load_flow_parts

loaded, load = [], transformers.PreTrainedModel.from_pretrained.__func__


def recorded(cls, path, *args, **kwargs):
    loaded.append(Path(path).name)
    return load(cls, path, *args, **kwargs)


transformers.PreTrainedModel.from_pretrained = classmethod(recorded)
load_flow_parts(sys.argv[1])
print(json.dumps(loaded))
"""


def test_the_text_encoders_load_in_the_order_of_their_names_not_of_string_hashes() -> None:
    """At ZeRO-3 each rank loads them collectively, so every rank must load them in one order. diffusers' own order
    follows the process's string hashes: with PYTHONHASHSEED=0 it is text_encoder_2, text_encoder_3, text_encoder."""
    seeded = subprocess.run(
        [sys.executable, "-c", LOADING_ORDER, TINY_SD3],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert seeded.returncode == 0, seeded.stderr[-2000:]
    assert json.loads(seeded.stdout.splitlines()[-1]) == ["text_encoder", "text_encoder_2", "text_encoder_3"]


FLOW_OVERRIDES = ["platform=cpu", "warm_start.base_model=''", "warm_start.output_dir=''", f"pretrain='{TINY_SD3}'"]
GROUP = ["regulariser_weight=0", "batch_size=2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sampling.min_timestep=900"], r"sampling.min_timestep=900 and sampling.max_timestep=1000 hold 1 of the 8"),
        (["algorithm=policy_gradient", *GROUP], "algorithm=policy_gradient is DDPO on a DDIM UNet"),
        (["trainable_models=[unet]"], r"set trainable_models=\[transformer\]"),
        (["actor.worker_cls=roll.pipeline.diffusion.diffusion_worker.RewardFLWorker"], "cannot hold a flow model"),
        (["algorithm=flow_grpo", "flow.noise_level=0", *GROUP], "flow.noise_level=0 leaves Flow-GRPO"),
        (["algorithm=flow_grpo", "flow.rollout_steps=9", *GROUP], "flow.rollout_steps=9 is more than sampling"),
        (["algorithm=flow_grpo", "batch_size=2"], "regulariser_weight=0.05 applies to algorithm=reward_fl or diff"),
    ],
)
def test_flow_config_errors_name_their_fields(tmp_path: Any, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("reward_fl_flow_shapes", [*FLOW_OVERRIDES, f"output_dir={tmp_path}", *overrides])


def test_flow_algorithms_need_a_flow_model(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="algorithm=diffusion_nft needs a flow-matching model"):
        load_config("reward_fl_shapes", ["platform=cpu", f"output_dir={tmp_path}", "algorithm=diffusion_nft", *GROUP])
    for algorithm in ("flow_grpo", "diffusion_nft"):
        config = load_config("reward_fl_flow_video", [f"output_dir={tmp_path}", f"algorithm={algorithm}", *GROUP])
        assert config.batch_size * config.policy.group_size == 8
