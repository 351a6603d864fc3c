"""A learned, differentiable image reward for GPU recipes: a linear aesthetic head on CLIP image embeddings.

This is the shape of LAION's aesthetic predictor (a linear layer on the L2-normalised image embedding of
CLIP ViT-L/14) and of the ImageReward/PickScore family: the image is resized to the vision tower's input,
normalised with CLIP's statistics, embedded, and scored by the head, all differentiably. Both files are
local: `clip_dir` is a transformers `CLIPVisionModelWithProjection` directory, `head_path` a
`torch.save`d state dict of a `torch.nn.Linear(projection_dim, 1)` (keys `weight`, `bias`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roll.rewards.image_rewards import ImageReward, encoder_pixels

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class CLIPAestheticReward(ImageReward):
    """`head(normalise(CLIP image embedding))` per image; gradients flow back to the pixels."""

    def __init__(self, clip_dir: str, head_path: str) -> None:
        super().__init__()
        from transformers import CLIPVisionModelWithProjection

        self.clip = CLIPVisionModelWithProjection.from_pretrained(clip_dir)
        self.head = torch.nn.Linear(self.clip.config.projection_dim, 1)
        self.head.load_state_dict(torch.load(head_path, map_location="cpu", weights_only=True))
        self.size = self.clip.config.image_size
        self.register_buffer("mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(CLIP_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The aesthetic score of each image `[B]`."""
        pixels = encoder_pixels(images, self.size, self.mean, self.std)
        embeds = self.clip(pixel_values=pixels.to(self.head.weight.dtype)).image_embeds
        return self.head(F.normalize(embeds, dim=-1)).squeeze(-1).to(images.dtype)
