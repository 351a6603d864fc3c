"""The prompts Reward FL samples from: a text file (one prompt a line) or the shapes demonstration's, split into
training and held-out prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from roll.configs.schema import check, checked_in_validate
from roll.pipeline.diffusion.shapes import all_prompts


@dataclass
class PromptDataArguments:
    """Where the prompts come from, which are held out, and how many images each held-out prompt is sampled."""

    prompt_file: str = field(
        default="",
        metadata=checked_in_validate("whether the file exists is the filesystem's; empty = the shapes", "/no/file"),
    )
    held_out_prompts: int = field(default=6, metadata=check(ge=1))
    # Images sampled per held-out prompt at each evaluation (the same noise every time).
    eval_images_per_prompt: int = field(default=4, metadata=check(ge=1))


def load_prompts(prompt_file: str) -> list[str]:
    """The non-empty lines of `prompt_file`, stripped; the shapes demonstration's prompts when it is empty."""
    if not prompt_file:
        return all_prompts()
    return [line.strip() for line in Path(prompt_file).read_text().splitlines() if line.strip()]


def prompt_splits(prompts: list[str], held_out: int) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): `held_out` prompts evenly spaced through `prompts` are held out, so a
    file ordered by topic (or the shapes, colour by colour) has each topic on both sides when there are enough."""
    if not 0 < held_out < len(prompts):
        raise ValueError(f"held_out={held_out} must be between 1 and {len(prompts) - 1} (of {len(prompts)} prompts)")
    stride = len(prompts) / held_out
    chosen = {int(i * stride + stride / 2) for i in range(held_out)}
    return [p for i, p in enumerate(prompts) if i not in chosen], [p for i, p in enumerate(prompts) if i in chosen]
