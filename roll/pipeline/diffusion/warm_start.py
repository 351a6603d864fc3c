"""The warm start of the demonstration: a diffusion model taught to draw the shapes, before Reward FL.

Plain denoising training (the epsilon-prediction loss on images drawn on the fly by `shapes`), with some
prompts dropped to the empty prompt so classifier-free guidance has an unconditional model. It runs once, in
the driver before any worker starts, and is reused while its directory holds a model made with the same
settings.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from roll.configs.schema import any_value, check
from roll.models.diffusion.parts import encode_prompts, load_diffusion_parts, save_diffusion_parts
from roll.pipeline.diffusion.shapes import all_prompts, draw_batch
from roll.utils.tracking import show_progress

WARM_START_MARKER = "roll_warm_start.json"


@dataclass
class WarmStartArguments:
    """Denoising training of `base_model` on the shapes into `output_dir` (empty `base_model`: no warm start, the
    actor's model is used as it is)."""

    base_model: str = field(default="", metadata=any_value("a diffusers directory or tiny-diffusion:// reference"))
    output_dir: str = field(default="", metadata=any_value("a directory; validate() checks it is writable"))
    steps: int = field(default=600, metadata=check(ge=1))
    batch_size: int = field(default=32, metadata=check(ge=1))
    learning_rate: float = field(default=2e-3, metadata=check(gt=0))
    # Share of prompts replaced by the empty prompt (the unconditional model of classifier-free guidance).
    prompt_dropout: float = field(default=0.1, metadata=check(ge=0, lt=1))
    seed: int = field(default=0, metadata=check(ge=0))


def warm_start_settings(args: WarmStartArguments) -> dict[str, object]:
    """The settings that make a warm start what it is (where it is written is not one)."""
    return {key: value for key, value in asdict(args).items() if key != "output_dir"}


def finished_warm_start(args: WarmStartArguments) -> dict[str, float] | None:
    """What the warm start in `args.output_dir` recorded (its final losses and seconds) if it was made with exactly
    these settings, else None."""
    try:
        marker = json.loads((Path(args.output_dir) / WARM_START_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker["result"] if marker.get("settings") == warm_start_settings(args) else None


def warm_start_done(args: WarmStartArguments) -> bool:
    """Whether `args.output_dir` holds a warm start made with exactly these settings."""
    return finished_warm_start(args) is not None


def seeded_rng(seed: int) -> random.Random:
    """A Python random generator seeded with `seed`, after seeding torch's with it too."""
    torch.manual_seed(seed)
    return random.Random(seed)


def run_warm_start(args: WarmStartArguments) -> dict[str, float]:
    """Train the warm start unless it exists; return its final loss and seconds (0 s when reused)."""
    if (finished := finished_warm_start(args)) is not None:
        return finished
    started = time.perf_counter()
    rng = seeded_rng(args.seed)
    parts = load_diffusion_parts(args.base_model)
    unet, text_encoder, scheduler = parts.unet.train(), parts.text_encoder.train(), parts.scheduler
    params = [*unet.parameters(), *text_encoder.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.learning_rate, total_steps=args.steps)
    prompts, size = all_prompts(), unet.config.sample_size
    losses: list[float] = []
    progress = show_progress(range(args.steps), desc="warm start")
    for _ in progress:
        batch = [rng.choice(prompts) for _ in range(args.batch_size)]
        images = draw_batch(batch, size, rng) * 2 - 1
        conditioned = ["" if rng.random() < args.prompt_dropout else prompt for prompt in batch]
        ids = encode_prompts(parts.tokenizer, conditioned)["input_ids"]
        noise = torch.randn_like(images)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (len(batch),))
        noisy = scheduler.add_noise(images, noise, timesteps)
        predicted = unet(noisy, timesteps, encoder_hidden_states=text_encoder(input_ids=ids).last_hidden_state).sample
        loss = torch.nn.functional.mse_loss(predicted, noise)
        losses.append(training_step(loss, params, optimizer, schedule))
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    return record_warm_start(args, lambda out: save_diffusion_parts(parts, out), losses, started)


def training_step(
    loss: torch.Tensor, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, schedule: Any
) -> float:
    """One optimizer step of a warm start on `loss` (gradients clipped to norm 1); the loss's value."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    return loss.item()


def record_warm_start(
    args: WarmStartArguments,
    save: Callable[[Path], object],
    losses: list[float],
    started: float,
    **extra: float,
) -> dict[str, float]:
    """Write the trained model with `save(output_dir)`, then its marker: the settings, and the result (the mean of
    the last tenth of `losses`, the seconds since `started`, and `extra`); return the result."""
    out = Path(args.output_dir)
    (out / WARM_START_MARKER).unlink(missing_ok=True)  # an interrupted run is never mistaken for a finished one
    save(out)
    tail = losses[-max(1, len(losses) // 10) :]
    result = extra | {"warm_start_loss": sum(tail) / len(tail), "warm_start_s": time.perf_counter() - started}
    marker = {"settings": warm_start_settings(args), "result": result}
    (out / WARM_START_MARKER).write_text(json.dumps(marker, indent=2))
    return result
