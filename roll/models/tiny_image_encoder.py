"""A small random image embedding network, built locally, for the identity reward's tests and CPU runs.

It is a transformers `CLIPVisionModelWithProjection` (one to a few layers) with a `preprocessor_config.json`
naming its pixel statistics, so `roll.rewards.identity_reward` loads it exactly as it loads a real vision
encoder from a directory. Nothing is downloaded. Its embeddings are random features, not identities: similar
images get similar embeddings, which is all a test of the reward's arithmetic needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from roll.models.tiny import save_on_any_rank

# The pixel statistics written beside the tiny encoder (CLIP's own would do; these are round on purpose).
TINY_ENCODER_MEAN = (0.5, 0.5, 0.5)
TINY_ENCODER_STD = (0.25, 0.25, 0.25)


def make_tiny_image_encoder(
    output_dir: str | Path,
    image_size: int = 16,
    hidden_size: int = 32,
    num_layers: int = 1,
    projection_dim: int = 16,
    seed: int = 0,
) -> Path:
    """Save a seeded random CLIP vision tower (patches of `image_size` // 4) with its preprocessor config in
    `output_dir`; return it."""
    path = Path(output_dir)
    config = CLIPVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // 16),
        image_size=image_size,
        patch_size=max(1, image_size // 4),
        projection_dim=projection_dim,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPVisionModelWithProjection(config)
    save_on_any_rank(model, path)
    processor = {"image_mean": list(TINY_ENCODER_MEAN), "image_std": list(TINY_ENCODER_STD)}
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path
