"""The demonstration data: prompts about small coloured shapes, and their images drawn on the fly.

"a blue circle" is a blue disc on a black background at a random place and size. The warm start learns to
draw them; Reward FL then samples from the prompts alone.
"""

from __future__ import annotations

import itertools
import random

import torch

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.1),
    "blue": (0.15, 0.25, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "cyan": (0.1, 0.9, 0.9),
    "magenta": (0.9, 0.1, 0.9),
    "white": (1.0, 1.0, 1.0),
    "orange": (1.0, 0.55, 0.1),
}
SHAPES = ("circle", "square", "triangle")


def all_prompts() -> list[str]:
    """Every prompt of the demonstration, colour by colour."""
    return [f"a {colour} {shape}" for colour, shape in itertools.product(COLOURS, SHAPES)]


def draw(prompt: str, size: int, rng: random.Random) -> torch.Tensor:
    """The image of `prompt` ("a <colour> <shape>") `[3, size, size]` in [0, 1]: the shape on black, placed and
    sized by `rng`."""
    radius = rng.uniform(size / 6, size / 3)
    return draw_at(prompt, size, rng.uniform(radius, size - radius), rng.uniform(radius, size - radius), radius)


def draw_at(prompt: str, size: int, cx: float, cy: float, radius: float) -> torch.Tensor:
    """The image of `prompt` `[3, size, size]`: its shape of `radius` centred at (`cx`, `cy`) pixels, on black."""
    _, colour, shape = prompt.split()
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        inside = dx**2 + dy**2 <= radius**2
    elif shape == "square":
        inside = (dx.abs() <= radius * 0.85) & (dy.abs() <= radius * 0.85)
    else:  # a triangle pointing up: below the two slanted edges, above the base
        inside = (dy <= radius * 0.8) & (dy >= -radius + 2 * dx.abs())
    return torch.tensor(COLOURS[colour]).view(3, 1, 1) * inside.float()


def draw_clip(prompt: str, size: int, frames: int, rng: random.Random) -> torch.Tensor:
    """A clip of `prompt` `[3, frames, size, size]`: its shape moving in a straight line from a random place in a
    random direction, staying inside the frame."""
    radius = rng.uniform(size / 6, size / 4)
    start = [rng.uniform(radius, size - radius) for _ in range(2)]
    end = [rng.uniform(radius, size - radius) for _ in range(2)]
    steps = max(frames - 1, 1)
    positions = [[a + (b - a) * f / steps for a, b in zip(start, end, strict=True)] for f in range(frames)]
    return torch.stack([draw_at(prompt, size, x, y, radius) for x, y in positions], dim=1)


def draw_batch(prompts: list[str], size: int, rng: random.Random) -> torch.Tensor:
    """Images of `prompts` `[B, 3, size, size]` in [0, 1]."""
    return torch.stack([draw(prompt, size, rng) for prompt in prompts])
