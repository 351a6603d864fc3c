"""Sampling a flow-matching model: Euler steps of its velocity, with the gradient kept through a window, and the
stochastic (SDE) step of Flow-GRPO with its Gaussian log-probability.

A flow model predicts the velocity v = noise - x0 of the straight path x_sigma = (1 - sigma) x0 + sigma noise;
an Euler step from sigma to the next, smaller, sigma moves x by (sigma_next - sigma) v. The sigmas come from
the model's `FlowMatchEulerDiscreteScheduler` (its shift included) and end at 0; the transformer sees the
timestep sigma x `num_train_timesteps`.

Reward FL keeps the gradient through exactly K Euler steps: the last K whose timestep lies in
[`min_timestep`, `max_timestep`]. Earlier steps run without autograd; later steps (below the window) run their
transformer without autograd too, but their Euler updates stay in the graph (the velocity taken as a
constant), so the reward's gradient still reaches the kept steps from the final sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from roll.pipeline.diffusion.policy_gradient import Trajectory, gaussian_log_prob
from roll.pipeline.diffusion.sampling import GradStepHook, SamplingArguments, predict_with_grad

# A step's log-probability divides the mean's error by its noise: below this standard deviation (the last step
# into sigma 0 from sigma ~0.001 has ~1e-3) the rounding differences between two passes of the same model
# (another attention kernel with autograd) move the ratio by more than PPO's clip. Such steps are masked out.
MIN_LOG_PROB_STD = 1e-2
# (noisy sample, timestep in [0, num_train_timesteps]) -> the predicted velocity.
VelocityPredictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def flow_sigmas(scheduler: object, steps: int) -> torch.Tensor:
    """The `steps` + 1 noise levels of `steps` Euler steps of `scheduler` (float32, from about 1 down to 0)."""
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float().cpu()


def model_timestep(sigma: torch.Tensor | float, scheduler: object) -> torch.Tensor:
    """The timestep the transformer is conditioned on at noise level `sigma`."""
    return torch.as_tensor(sigma, dtype=torch.float32) * scheduler.config.num_train_timesteps


def kept_steps(sigmas: torch.Tensor, args: SamplingArguments, num_train_timesteps: int) -> list[bool]:
    """Which Euler steps keep their gradient: the last `args.grad_steps` of those whose timestep (sigma x
    `num_train_timesteps`) lies in [`args.min_timestep`, `args.max_timestep`]; fewer when fewer lie there."""
    inside = [
        index
        for index, sigma in enumerate(sigmas[:-1].tolist())
        if args.min_timestep <= sigma * num_train_timesteps <= args.max_timestep
    ]
    chosen = set(inside[len(inside) - args.grad_steps :]) if inside else set()
    return [index in chosen for index in range(len(sigmas) - 1)]


def euler_step(sample: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """One Euler step of the flow from `sigma` to `sigma_next`."""
    return sample + (sigma_next - sigma) * velocity


def denoise_flow(
    predict: VelocityPredictor,
    scheduler: object,
    noise: torch.Tensor,
    args: SamplingArguments,
    checkpointed: bool = False,
    on_grad_step: GradStepHook | None = None,
) -> torch.Tensor:
    """Sample from `noise` in `args.num_inference_steps` Euler steps; the gradient flows through `kept_steps` only.

    With `checkpointed` each kept step's transformer pass is recomputed in the backward pass. `on_grad_step`
    sees each kept step's input (detached), timestep and velocity (with gradient).
    """
    sigmas = flow_sigmas(scheduler, args.num_inference_steps)
    keep = kept_steps(sigmas, args, scheduler.config.num_train_timesteps)
    sample = noise
    for index, keeps_grad in enumerate(keep):
        sigma, sigma_next = sigmas[index].item(), sigmas[index + 1].item()
        timestep = model_timestep(sigma, scheduler).to(noise.device)
        if keeps_grad:
            velocity = predict_with_grad(predict, sample, timestep, checkpointed, on_grad_step)
        else:
            with torch.no_grad():
                velocity = predict(sample, timestep)
        sample = euler_step(sample, velocity, sigma, sigma_next)
    return sample


def sde_gaussian(
    sample: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float, noise_level: float, sigma_cap: float
) -> tuple[torch.Tensor, float]:
    """Mean and standard deviation of Flow-GRPO's SDE step from `sigma` to `sigma_next`.

    The reverse SDE with the same marginals as the flow has diffusion g = `noise_level` x sqrt(sigma / (1 - sigma))
    (at sigma = 1 the denominator uses `sigma_cap`, the next level of the schedule); its Euler-Maruyama step
    adds g^2 / (2 sigma) x (x + (1 - sigma) v) dt to the flow's drift and noise of variance g^2 |dt|.
    """
    dt = sigma_next - sigma
    diffusion = noise_level * math.sqrt(sigma / (1 - (sigma_cap if sigma >= 1 else sigma)))
    drift_factor = diffusion**2 / (2 * sigma)
    mean = sample * (1 + drift_factor * dt) + velocity * (1 + drift_factor * (1 - sigma)) * dt
    return mean, diffusion * math.sqrt(-dt)


@torch.no_grad()
def sample_sde_trajectory(
    predict: VelocityPredictor, scheduler: object, noise: torch.Tensor, steps: int, noise_level: float
) -> Trajectory:
    """Sample from `noise` in `steps` SDE steps (`noise_level` 0: the deterministic Euler sampler), recording every
    sample and its log-probability; `timesteps` holds each step's sigma. Steps whose noise is below
    `MIN_LOG_PROB_STD` are masked out of the update (`step_mask`), as steps without noise are."""
    sigmas = flow_sigmas(scheduler, steps)
    latents, log_probs, stds = [noise], [], []
    for index in range(steps):
        sigma, sigma_next = sigmas[index].item(), sigmas[index + 1].item()
        timestep = model_timestep(sigma, scheduler).to(noise.device)
        velocity = predict(latents[-1], timestep)
        mean, std = sde_gaussian(latents[-1], velocity, sigma, sigma_next, noise_level, sigmas[1].item())
        latents.append(mean + std * torch.randn_like(mean))
        log_probs.append(gaussian_log_prob(latents[-1], mean, std))
        stds.append(std)
    steps_with_log_prob = torch.tensor(stds) > MIN_LOG_PROB_STD
    return Trajectory(torch.stack(latents, dim=1), torch.stack(log_probs, dim=1), steps_with_log_prob, sigmas[:-1])


def sde_step_log_probs(
    predict: VelocityPredictor, scheduler: object, latents: torch.Tensor, sigmas: torch.Tensor, noise_level: float
) -> torch.Tensor:
    """The log-probability `[B, T]` of each recorded SDE step `latents[:, i] -> latents[:, i + 1]` (from noise level
    `sigmas[i]` to the next, 0 after the last) under `predict`, with gradient."""
    levels = [*sigmas.tolist(), 0.0]
    log_probs = []
    for index in range(len(sigmas)):
        sample = latents[:, index]
        velocity = predict(sample, model_timestep(levels[index], scheduler).to(sample.device))
        mean, std = sde_gaussian(sample, velocity, levels[index], levels[index + 1], noise_level, levels[1])
        log_probs.append(gaussian_log_prob(latents[:, index + 1], mean, std))
    return torch.stack(log_probs, dim=1)


def nft_optimality(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r in [0, 1] of each sample from its group-relative advantage:
    0.5 + 0.5 x clamp(advantage / `clip`, -1, 1)."""
    return 0.5 + 0.5 * (advantages / clip).clamp(-1, 1)


def nft_loss(
    velocity: torch.Tensor, old_velocity: torch.Tensor, target: torch.Tensor, optimality: torch.Tensor, beta: float
) -> torch.Tensor:
    """DiffusionNFT's loss per row `[B]`: r x |v+ - target|^2 + (1 - r) x |v- - target|^2, element means.

    The implicit positive policy is v+ = v_old + beta (v - v_old) and the negative v- = v_old - beta (v - v_old):
    raising r pulls the trained velocity `velocity` toward the flow-matching `target` of good samples and pushes
    it away for bad ones, with no likelihood and no sampler in the loss.
    """
    step = beta * (velocity - old_velocity.detach())
    positive = (old_velocity.detach() + step - target).pow(2).flatten(1).mean(dim=1)
    negative = (old_velocity.detach() - step - target).pow(2).flatten(1).mean(dim=1)
    return optimality * positive + (1 - optimality) * negative
