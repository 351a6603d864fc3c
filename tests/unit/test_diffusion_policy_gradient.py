"""The policy-gradient variant's stochastic DDIM steps: the same Gaussian as diffusers' step, log-probabilities by
hand, and a rollout's log-probabilities recomputed exactly (ratio 1 before any update)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDIMScheduler

from roll.pipeline.diffusion.policy_gradient import (
    ddim_gaussian,
    gaussian_log_prob,
    sample_trajectory,
    step_log_probs,
)


@pytest.fixture
def scheduler() -> DDIMScheduler:
    ddim = DDIMScheduler(num_train_timesteps=1000, clip_sample=False, set_alpha_to_one=True)
    ddim.set_timesteps(4)
    return ddim


# What a model's scheduler may say besides the defaults: what the network predicts, and how x_0 is clipped.
SCHEDULER_VARIANTS = {
    "epsilon": {},
    "v_prediction": {"prediction_type": "v_prediction"},
    "sample": {"prediction_type": "sample"},
    "clip_sample": {"clip_sample": True, "clip_sample_range": 0.5},
    "thresholding": {"thresholding": True, "sample_max_value": 0.8},
}


@pytest.mark.parametrize("variant", SCHEDULER_VARIANTS)
@pytest.mark.parametrize("eta", [0.5, 1.0])
def test_the_gaussian_is_the_one_diffusers_samples_from(variant: str, eta: float) -> None:
    """The rollout's step is the scheduler's own, whatever its prediction type, clipping or thresholding, so a
    policy-gradient run samples as its evaluation (the scheduler's step) does."""
    scheduler = DDIMScheduler(
        num_train_timesteps=1000, set_alpha_to_one=True, **{"clip_sample": False, **SCHEDULER_VARIANTS[variant]}
    )
    scheduler.set_timesteps(4)
    generator = torch.Generator().manual_seed(0)
    sample, predicted, noise = (2 * torch.randn(2, 3, 4, 4, generator=generator) for _ in range(3))
    for timestep in scheduler.timesteps[:-1]:
        mean, std = ddim_gaussian(scheduler, predicted, timestep, sample, eta)
        stepped = scheduler.step(predicted, timestep, sample, eta=eta, variance_noise=noise).prev_sample
        assert std > 0
        assert torch.allclose(mean + std * noise, stepped, atol=1e-5)


def test_log_prob_by_hand_and_zero_without_variance() -> None:
    value, mean = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 2.0]])
    expected = (
        -(1.0**2) / (2 * 0.25)
        - math.log(0.5)
        - 0.5 * math.log(2 * math.pi)
        - math.log(0.5)
        - 0.5 * math.log(2 * math.pi)
    ) / 2
    assert gaussian_log_prob(value, mean, 0.5).item() == pytest.approx(expected)
    assert gaussian_log_prob(value, mean, 0.0).tolist() == [0.0]


def test_a_rollout_recomputes_to_ratio_one_and_masks_the_deterministic_last_step(scheduler: DDIMScheduler) -> None:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.tensor(0.3))
    trajectory = sample_trajectory(lambda x, t: weight * x, scheduler, torch.randn(2, 3, 4, 4), 4, 1.0)
    assert trajectory.latents.shape == (2, 5, 3, 4, 4) and trajectory.log_probs.shape == (2, 4)
    assert trajectory.step_mask.tolist() == [True, True, True, False]  # the schedule ends at alpha = 1
    recomputed = step_log_probs(lambda x, t: weight * x, scheduler, trajectory.latents, trajectory.timesteps, 1.0)
    assert torch.equal(recomputed.detach(), trajectory.log_probs)
    recomputed[:, :3].sum().backward()
    assert weight.grad is not None and weight.grad.item() != 0
