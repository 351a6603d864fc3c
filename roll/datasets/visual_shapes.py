"""A synthetic visual task rendered with PIL: count the coloured squares in a small picture.

Each problem is one image of 1 to `max_count` filled squares of random colours at random non-overlapping places
on a white canvas, the question "How many squares?" and the count as the answer. Train and held-out problems are
drawn from different seeds, and a held-out picture that happens to equal a training one is drawn again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS = ("red", "green", "blue", "orange", "purple", "black")
QUESTION = "How many squares?"
CANVAS = 84  # pixels a side: 6 x 6 patches of 14, 9 image tokens after Qwen's 2 x 2 merge
SQUARE = 14


@dataclass(frozen=True)
class ShapeProblem:
    """A picture, its question and the count it shows."""

    image: Image.Image
    question: str
    answer: str


def draw_squares(count: int, rng: random.Random) -> Image.Image:
    """A white canvas with `count` squares of random colours on distinct cells of a 5 x 5 grid, jittered."""
    image = Image.new("RGB", (CANVAS, CANVAS), "white")
    draw = ImageDraw.Draw(image)
    cell = CANVAS // 5
    for index in rng.sample(range(25), count):
        left = (index % 5) * cell + rng.randint(0, cell - SQUARE)
        top = (index // 5) * cell + rng.randint(0, cell - SQUARE)
        draw.rectangle((left, top, left + SQUARE - 1, top + SQUARE - 1), fill=rng.choice(COLOURS))
    return image


def shape_problems(train_size: int, held_out_size: int, max_count: int = 4, seed: int = 0) -> tuple[list, list]:
    """(train, held out) counting problems, counts 1..`max_count` equally likely, from seeds that never meet."""
    if not 1 <= max_count <= 9:
        raise ValueError(f"max_count={max_count} must be 1 to 9 (one digit answers, at most 25 cells)")

    seen: set[bytes] = set()

    def draw(size: int, stream: int) -> list[ShapeProblem]:
        rng = random.Random(f"{seed}-{stream}")
        counts = [1 + i % max_count for i in range(size)]
        rng.shuffle(counts)
        problems = []
        for count in counts:
            image = draw_squares(count, rng)
            while stream and image.tobytes() in seen:  # a held-out picture is never a training one
                image = draw_squares(count, rng)
            seen.add(image.tobytes())
            problems.append(ShapeProblem(image, QUESTION, str(count)))
        return problems

    return draw(train_size, 0), draw(held_out_size, 1)
