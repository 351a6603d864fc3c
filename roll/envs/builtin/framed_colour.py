"""framed_colour: pictures for a vision-language policy; each names the colour of the framed one of two squares.

An episode shows `pictures` pictures one after another (`roll.datasets.visual_shapes.draw_framed`, drawn from the
reset's seed). Every observation is text and an image; each answer scores 1 when its last word is the framed
square's colour, 0 otherwise, and the next picture follows until the last is answered (terminated). `success` is
the share of pictures named right.
"""

from __future__ import annotations

import random

from roll.datasets.visual_shapes import COLOUR_QUESTION, draw_framed
from roll.envs.protocol import SUCCESS, Observation, ResetResult, StepResult
from roll.envs.registry import register_env


@register_env("framed_colour")
class FramedColourEnv:
    """Name the framed square's colour in each of `pictures` pictures."""

    def __init__(self, pictures: int = 2) -> None:
        if pictures < 1:
            raise ValueError(f"pictures ({pictures}) must be at least 1")
        self.pictures = pictures
        self.rng = random.Random()
        self.answer = ""
        self.shown = 0
        self.correct = 0

    def _picture(self, lead: str) -> Observation:
        image, self.answer = draw_framed(self.rng)
        self.shown += 1
        return [
            {"type": "text", "text": lead},
            {"type": "image", "image": image},
            {"type": "text", "text": COLOUR_QUESTION},
        ]

    def reset(self, seed: int | None = None) -> ResetResult:
        """The first picture of the episode `seed` draws."""
        self.rng, self.shown, self.correct = random.Random(seed), 0, 0
        return self._picture(""), {}

    def step(self, action: str) -> StepResult:
        """Score the answer; show the next picture, or end after the last."""
        words = action.strip().lower().split()
        reward = float(bool(words) and words[-1] == self.answer)
        self.correct += int(reward)
        if self.shown >= self.pictures:
            return "done", reward, True, False, {SUCCESS: self.correct / self.pictures}
        return self._picture("next: "), reward, False, False, {}
