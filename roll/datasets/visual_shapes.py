"""Synthetic visual tasks rendered with PIL, on small pictures of coloured squares.

- count (`shape_problems`): 1 to `max_count` filled squares of random colours at random non-overlapping places on
  a white canvas; the question "How many squares?", the count as the answer.
- colour (`colour_problems`): two squares of different colours, one of them framed in black; the question asks
  the framed square's colour, named as a word.

Train and held-out problems are drawn from different seeds, and a held-out picture that happens to equal a
training one is drawn again.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS = ("red", "green", "blue", "orange", "purple", "black")
QUESTION = "How many squares?"
# The colour task's colours (named by the answer, one first letter each) and question.
NAMED_COLOURS = ("red", "green", "blue", "yellow")
COLOUR_QUESTION = "Colour of the framed square?"
FRAMED = 28  # pixels a side of the colour task's squares, the frame's 3 included
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


def draw_framed(rng: random.Random) -> tuple[Image.Image, str]:
    """A white canvas with two squares of different named colours in two of its four quarters, one framed in black;
    the framed square's colour."""
    image = Image.new("RGB", (CANVAS, CANVAS), "white")
    draw = ImageDraw.Draw(image)
    half = CANVAS // 2
    colours = rng.sample(NAMED_COLOURS, 2)
    for quarter, colour, framed in zip(rng.sample(range(4), 2), colours, (True, False), strict=True):
        left = (quarter % 2) * half + rng.randint(0, half - FRAMED)
        top = (quarter // 2) * half + rng.randint(0, half - FRAMED)
        box = (left, top, left + FRAMED - 1, top + FRAMED - 1)
        draw.rectangle(box, fill=colour, outline="black" if framed else colour, width=3)
    return image, colours[0]


def shape_problems(train_size: int, held_out_size: int, max_count: int = 4, seed: int = 0) -> tuple[list, list]:
    """(train, held out) counting problems, counts 1..`max_count` equally likely, from seeds that never meet."""
    if not 1 <= max_count <= 9:
        raise ValueError(f"max_count={max_count} must be 1 to 9 (one digit answers, at most 25 cells)")

    def problem(index: int, rng: random.Random) -> tuple[Image.Image, str]:
        count = 1 + index % max_count
        return draw_squares(count, rng), str(count)

    return _split(problem, QUESTION, train_size, held_out_size, seed)


def colour_problems(train_size: int, held_out_size: int, seed: int = 0) -> tuple[list, list]:
    """(train, held out) problems naming the framed square's colour, from seeds that never meet."""
    return _split(lambda index, rng: draw_framed(rng), COLOUR_QUESTION, train_size, held_out_size, seed)


def _split(
    problem: Callable[[int, random.Random], tuple[Image.Image, str]],
    question: str,
    train_size: int,
    held_out_size: int,
    seed: int,
) -> tuple[list[ShapeProblem], list[ShapeProblem]]:
    """Train and held-out problems of `problem(index, rng)`; a held-out picture equal to a training one is drawn
    again."""
    seen: set[bytes] = set()

    def draw(size: int, stream: int) -> list[ShapeProblem]:
        rng = random.Random(f"{seed}-{stream}")
        order = list(range(size))
        rng.shuffle(order)
        problems = []
        for index in order:
            image, answer = problem(index, rng)
            while stream and image.tobytes() in seen:  # a held-out picture is never a training one
                image, answer = problem(index, rng)
            seen.add(image.tobytes())
            problems.append(ShapeProblem(image, question, answer))
        return problems

    return draw(train_size, 0), draw(held_out_size, 1)
