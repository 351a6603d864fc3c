"""The CLIP aesthetic reward (the GPU recipe's scorer) on a tiny random CLIP vision tower built locally."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from roll.rewards.clip_aesthetic import CLIPAestheticReward
from roll.rewards.image_rewards import build_image_reward


def test_scores_are_differentiable_in_the_pixels_and_follow_the_head(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=8,
    )
    CLIPVisionModelWithProjection(config).save_pretrained(tmp_path / "clip")
    head = torch.nn.Linear(8, 1)
    torch.save(head.state_dict(), tmp_path / "head.pt")
    reward = build_image_reward(
        "roll.rewards.clip_aesthetic.CLIPAestheticReward",
        {"clip_dir": str(tmp_path / "clip"), "head_path": str(tmp_path / "head.pt")},
    )
    assert isinstance(reward, CLIPAestheticReward) and not any(p.requires_grad for p in reward.parameters())
    images = torch.rand(3, 3, 16, 16, requires_grad=True)
    scores = reward(images, ["", "", ""])
    assert scores.shape == (3,) and len(set(scores.tolist())) == 3
    scores.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    with torch.no_grad():
        reward.head.bias.add_(1.0)
        assert torch.allclose(reward(images, ["", "", ""]), scores + 1, atol=1e-6)
