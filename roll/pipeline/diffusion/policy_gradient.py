"""The policy-gradient variant (DDPO / Flow-GRPO style) for rewards without a gradient.

Sampling is stochastic (DDIM with `eta` > 0: each step draws x_{t-1} from a Gaussian around the
deterministic DDIM update), so every step has a log-probability under the model. A rollout records each
step's sample and log-probability; the update recomputes them under the current model and steps on the
PPO clipped surrogate of `roll.algorithms.policy_losses.policy_loss` with group-relative advantages
(`roll.algorithms.reward_shaping.normalize_scores`), one "token" per denoising step. A step whose
Gaussian has no variance (the last one, when the schedule ends at alpha = 1) has no log-probability and
is masked out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from roll.configs.schema import check
from roll.pipeline.diffusion.sampling import NoisePredictor


@dataclass
class PolicyGradientArguments:
    """Settings of `algorithm=policy_gradient`: samples per prompt, sampling noise and the PPO clip."""

    # Images per prompt: their rewards are normalised within the group (GRPO's advantage).
    group_size: int = field(default=4, metadata=check(ge=2))
    # DDIM's eta while sampling rollouts (0 would make every step deterministic, without a log-probability).
    eta: float = field(default=1.0, metadata=check(gt=0, le=1))
    # PPO's clip of the per-step ratio; log-probabilities of images are sums over many pixels, so it is small.
    clip_range: float = field(default=1e-3, metadata=check(gt=0, lt=1))


@dataclass
class Trajectory:
    """One rollout: `latents` `[B, T + 1, C, H, W]` (x_T first), `log_probs` `[B, T]` of each step's sample,
    `step_mask` `[T]` (steps with a log-probability) and the `timesteps` `[T]`."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    step_mask: torch.Tensor
    timesteps: torch.Tensor


def ddim_gaussian(
    scheduler: object, predicted: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor, eta: float
) -> tuple[torch.Tensor, float]:
    """The mean and standard deviation of the scheduler's stochastic DDIM step from `sample` at `timestep` given the
    model's output. The mean is `scheduler.step` itself with zero noise, so the model's `prediction_type`,
    `clip_sample` and `thresholding` shape a rollout's steps as they shape the evaluation's samples."""
    step = scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    previous = int(timestep) - step
    alpha = scheduler.alphas_cumprod[int(timestep)].item()
    alpha_prev = scheduler.alphas_cumprod[previous].item() if previous >= 0 else scheduler.final_alpha_cumprod.item()
    variance = (1 - alpha_prev) / (1 - alpha) * (1 - alpha / alpha_prev)
    std = eta * math.sqrt(max(variance, 0.0))
    mean = scheduler.step(predicted, timestep, sample, eta=eta, variance_noise=torch.zeros_like(sample)).prev_sample
    return mean, std


def gaussian_log_prob(value: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """The mean over each row's elements of the log-density of N(mean, std²) at `value` `[B]` (0 when std = 0),
    in float32 whatever the model's dtype (ratios of bf16 log-probabilities would be noise)."""
    if std == 0:
        return torch.zeros(len(value), dtype=torch.float32, device=value.device)
    squared = (value.detach().float() - mean.float()) ** 2
    density = -squared / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return density.flatten(1).mean(dim=1)


@torch.no_grad()
def sample_trajectory(
    predict: NoisePredictor, scheduler: object, noise: torch.Tensor, steps: int, eta: float
) -> Trajectory:
    """Sample from `noise` in `steps` stochastic DDIM steps, recording every sample and its log-probability."""
    scheduler.set_timesteps(steps, device=noise.device)
    latents, log_probs, stds = [noise], [], []
    for timestep in scheduler.timesteps:
        mean, std = ddim_gaussian(scheduler, predict(latents[-1], timestep), timestep, latents[-1], eta)
        latents.append(mean + std * torch.randn_like(mean))
        log_probs.append(gaussian_log_prob(latents[-1], mean, std))
        stds.append(std)
    return Trajectory(
        torch.stack(latents, dim=1), torch.stack(log_probs, dim=1), torch.tensor(stds) > 0, scheduler.timesteps.cpu()
    )


def step_log_probs(
    predict: NoisePredictor, scheduler: object, latents: torch.Tensor, timesteps: torch.Tensor, eta: float
) -> torch.Tensor:
    """The log-probability `[B, T]` of each recorded step `latents[:, i] -> latents[:, i + 1]` under `predict`,
    with gradient."""
    scheduler.set_timesteps(len(timesteps), device=latents.device)
    log_probs = []
    for index, timestep in enumerate(timesteps.tolist()):
        sample = latents[:, index]
        mean, std = ddim_gaussian(scheduler, predict(sample, torch.tensor(timestep)), timestep, sample, eta)
        log_probs.append(gaussian_log_prob(latents[:, index + 1], mean, std))
    return torch.stack(log_probs, dim=1)
