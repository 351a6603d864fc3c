"""The denoising loop of Reward FL: DDIM sampling whose gradient flows through the last K steps only.

This is DRaFT-K's truncation (ReFL and ROLL's Reward FL keep gradients through a late window as well): the
early steps run without autograd, so memory grows with K, not with the number of inference steps. A step
keeps its gradient when it is one of the last `grad_steps` and its timestep lies in
[`min_timestep`, `max_timestep`]; the input of the first gradient step is a constant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from roll.configs.schema import check

# (noisy sample, timestep) -> the predicted noise.
NoisePredictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Called at each gradient step with its input sample (detached), timestep and predicted noise (with gradient).
GradStepHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class SamplingArguments:
    """How images are sampled during Reward FL and evaluation."""

    num_inference_steps: int = field(default=8, metadata=check(ge=1))
    # K: the last K denoising steps keep their gradient (within the timestep range); the earlier ones run without.
    grad_steps: int = field(default=2, metadata=check(ge=1))
    # Classifier-free guidance: 1 uses the prompt alone (one UNet pass per step), > 1 also the empty prompt.
    guidance_scale: float = field(default=1.0, metadata=check(ge=1))
    # Only steps whose timestep lies in [min_timestep, max_timestep] keep their gradient (of the training timesteps).
    min_timestep: int = field(default=0, metadata=check(ge=0))
    max_timestep: int = field(default=1000, metadata=check(ge=1))
    # DDIM's eta: 0 samples deterministically from the initial noise.
    eta: float = field(default=0.0, metadata=check(ge=0, le=1))


def gradient_step_mask(timesteps: torch.Tensor, args: SamplingArguments) -> list[bool]:
    """Which of the denoising steps at `timesteps` (in sampling order) keep their gradient.

    ValueError, naming the fields, when the steps that keep it do not run on to the last step: a step without
    gradient after them would cut the reward's gradient (leaving only the regulariser to train), and with none
    at all nothing would train.
    """
    count = len(timesteps)
    mask = [
        index >= count - args.grad_steps and args.min_timestep <= int(t) <= args.max_timestep
        for index, t in enumerate(timesteps)
    ]
    first = mask.index(True) if True in mask else count
    if first == count or not all(mask[first:]):
        raise ValueError(
            f"sampling.min_timestep={args.min_timestep} and sampling.max_timestep={args.max_timestep} leave the last "
            f"denoising step (timestep {int(timesteps[-1])} of sampling.num_inference_steps={count}) out of the "
            "gradient window: the steps after the window run without gradient and cut the reward's gradient; widen "
            f"the window to include timestep {int(timesteps[-1])}"
        )
    return mask


def denoise(
    predict: NoisePredictor,
    scheduler: object,
    noise: torch.Tensor,
    args: SamplingArguments,
    checkpointed: bool = False,
    on_grad_step: GradStepHook | None = None,
) -> torch.Tensor:
    """Sample from `noise` in `args.num_inference_steps` DDIM steps of `scheduler`; return the final sample.

    Steps outside `gradient_step_mask` run under `torch.no_grad()`; with `checkpointed`, each gradient step's
    noise prediction is recomputed in the backward pass instead of keeping its activations.
    """
    scheduler.set_timesteps(args.num_inference_steps, device=noise.device)
    sample = noise
    for timestep, keeps_grad in zip(scheduler.timesteps, gradient_step_mask(scheduler.timesteps, args), strict=True):
        if not keeps_grad:
            with torch.no_grad():
                sample = scheduler.step(predict(sample, timestep), timestep, sample, eta=args.eta).prev_sample
            continue
        predicted = predict_with_grad(predict, sample, timestep, checkpointed, on_grad_step)
        sample = scheduler.step(predicted, timestep, sample, eta=args.eta).prev_sample
    return sample


def predict_with_grad(
    predict: NoisePredictor,
    sample: torch.Tensor,
    timestep: torch.Tensor,
    checkpointed: bool,
    on_grad_step: GradStepHook | None,
) -> torch.Tensor:
    """`predict(sample, timestep)` with gradient, recomputed in the backward pass instead of keeping its activations
    when `checkpointed`; `on_grad_step` sees the step's input (detached), timestep and prediction."""
    if checkpointed:
        predicted = checkpoint(predict, sample, timestep, use_reentrant=False)
    else:
        predicted = predict(sample, timestep)
    if on_grad_step is not None:
        on_grad_step(sample.detach(), timestep, predicted)
    return predicted
