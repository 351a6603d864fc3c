"""The warm start of the flow demonstrations: a tiny flow-matching model taught to draw the shapes (or clips
of them moving), before Reward FL, Flow-GRPO or DiffusionNFT.

First its VAE learns to reconstruct the images (a random VAE would decode nothing recognisable), then the
transformer learns the rectified-flow loss (velocity noise - x0 at x_sigma = (1 - sigma) x0 + sigma noise) on
the VAE's latents, some prompts dropped to the empty prompt so classifier-free guidance has an unconditional
model. Runs once in the driver and is reused, as `warm_start` does for the UNet.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

import torch

from roll.models.diffusion.flow_parts import FlowParts, flow_family, load_flow_parts, save_flow_parts
from roll.pipeline.diffusion.flow_model import encode_flow_prompts
from roll.pipeline.diffusion.shapes import all_prompts, draw_batch, draw_clip
from roll.pipeline.diffusion.warm_start import (
    WarmStartArguments,
    finished_warm_start,
    record_warm_start,
    run_warm_start,
    seeded_rng,
    training_step,
)
from roll.utils.tracking import show_progress

if TYPE_CHECKING:
    from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig

# Weight of the VAE's KL term: small, so latents stay near N(0, 1) without blurring the tiny images.
KL_WEIGHT = 1e-4
# Encoded examples per prompt in the transformer's training pool.
POOL_PER_PROMPT = 16


def shape_batch(parts: FlowParts, prompts: list[str], size: int, frames: int, rng: random.Random) -> torch.Tensor:
    """Images `[B, 3, H, W]` (or clips `[B, 3, F, H, W]` for a video model) of `prompts` in [-1, 1]."""
    if parts.family == "image":
        return draw_batch(prompts, size, rng) * 2 - 1
    return torch.stack([draw_clip(prompt, size, frames, rng) for prompt in prompts]) * 2 - 1


def to_latents(parts: FlowParts, pixels: torch.Tensor) -> torch.Tensor:
    """The VAE's mean latents of `pixels`, scaled as the pipeline scales them before the transformer."""
    config = parts.vae.config
    latents = parts.vae.encode(pixels).latent_dist.mean
    if parts.family == "image":
        return (latents - config.shift_factor) * config.scaling_factor
    view = (1, -1, 1, 1, 1)
    return (latents - torch.tensor(config.latents_mean).view(view)) / torch.tensor(config.latents_std).view(view)


def unclamped_decode(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """The VAE decoder's output before `decode` clamps it to [-1, 1] (the Wan VAE does): a clamped pixel has no
    gradient, and pixels pushed below black early in training would never learn to light up."""
    outputs: list[torch.Tensor] = []
    handle = vae.decoder.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        vae.decode(latents)
    finally:
        handle.remove()
    return torch.cat(outputs, dim=2) if latents.dim() == 5 else outputs[0]


def train_vae(parts: FlowParts, args: WarmStartArguments, size: int, frames: int, rng: random.Random) -> float:
    """Reconstruction training of the VAE on the shapes; then its latent scale is set so they have unit spread."""
    vae, prompts = parts.vae.train(), all_prompts()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.learning_rate)
    loss = torch.zeros(())
    for _ in show_progress(range(max(1, args.steps // 3)), desc="warm start: VAE"):
        pixels = shape_batch(parts, [rng.choice(prompts) for _ in range(args.batch_size)], size, frames, rng)
        posterior = vae.encode(pixels).latent_dist
        loss = torch.nn.functional.mse_loss(unclamped_decode(vae, posterior.sample()), pixels)
        loss = loss + KL_WEIGHT * posterior.kl().mean() / pixels[0].numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        pixels = shape_batch(parts, prompts, size, frames, rng)
        latents = vae.encode(pixels).latent_dist.mean
        if parts.family == "image":
            vae.register_to_config(shift_factor=latents.mean().item(), scaling_factor=1 / latents.std().item())
        else:
            dims = [0, 2, 3, 4]
            vae.register_to_config(
                latents_mean=latents.mean(dim=dims).tolist(), latents_std=latents.std(dim=dims).tolist()
            )
    return loss.item()


def warm_start_of(config: RewardFLConfig) -> dict[str, float]:
    """Run the warm start `config.warm_start` names, if any: this module's for a flow model, `warm_start`'s for a
    UNet; its losses and seconds."""
    warm = config.warm_start
    if not warm.base_model:
        return {}
    if flow_family(warm.base_model) is None:
        return run_warm_start(warm)
    return run_flow_warm_start(warm, config.flow.image_size, config.flow.frames)


def run_flow_warm_start(args: WarmStartArguments, image_size: int, frames: int) -> dict[str, float]:
    """Train the VAE (a third of the steps) then the transformer (all the steps) on `image_size`-pixel shapes
    (`frames` per clip for video) unless the warm start exists; its final losses and seconds (0 s when reused)."""
    if (finished := finished_warm_start(args)) is not None:
        return finished
    started = time.perf_counter()
    rng = seeded_rng(args.seed)
    parts = load_flow_parts(args.base_model)
    if not image_size and parts.family == "video":
        raise ValueError("flow.image_size=0: a video model has no size of its own; set flow.image_size")
    factor = 2 ** (len(parts.vae.config.block_out_channels) - 1) if parts.family == "image" else 1
    image_size = image_size or parts.transformer.config.sample_size * factor
    vae_loss = train_vae(parts, args, image_size, frames, rng)
    prompts, losses = all_prompts(), []
    # The transformer learns from a fixed pool of encoded examples: encoding every batch would cost more than
    # the transformer's own step on these sizes.
    pool_prompts = [prompt for prompt in prompts for _ in range(POOL_PER_PROMPT)]
    with torch.no_grad():
        pool = torch.cat(
            [
                to_latents(parts, shape_batch(parts, pool_prompts[i : i + 64], image_size, frames, rng))
                for i in range(0, len(pool_prompts), 64)
            ]
        )
    transformer = parts.transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.learning_rate, total_steps=args.steps)
    progress = show_progress(range(args.steps), desc="warm start: transformer")
    for _ in progress:
        rows = [rng.randrange(len(pool)) for _ in range(args.batch_size)]
        clean = pool[rows]
        conditioned = ["" if rng.random() < args.prompt_dropout else pool_prompts[row] for row in rows]
        noise = torch.randn_like(clean)
        sigma = torch.rand(len(rows))
        view = (-1,) + (1,) * (clean.dim() - 1)
        noisy = (1 - sigma.view(view)) * clean + sigma.view(view) * noise
        velocity = transformer(
            hidden_states=noisy,
            timestep=sigma * parts.scheduler.config.num_train_timesteps,
            **encode_flow_prompts(parts, conditioned),
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(velocity, noise - clean)
        losses.append(training_step(loss, list(transformer.parameters()), optimizer, schedule))
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    save = lambda out: save_flow_parts(parts, out)  # noqa: E731
    return record_warm_start(args, save, losses, started, warm_start_vae_loss=vae_loss)
