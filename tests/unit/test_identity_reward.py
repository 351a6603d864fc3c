"""The identity reward on a small embedding network built locally: similarity to the reference image, its gradient,
videos (mean over frames plus temporal consistency), the other rewards on videos, and its YAML fields checked."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image

from roll.configs.schema import ConfigError
from roll.models.tiny_image_encoder import make_tiny_image_encoder
from roll.rewards.identity_reward import IdentityReward, load_image
from roll.rewards.image_rewards import build_image_reward
from tests.unit.test_diffusion_config import reward_fl, valid  # noqa: F401 (valid: the example YAML's fixture)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny encoder directory and a 16x16 reference image (a red square on grey)."""
    root = tmp_path_factory.mktemp("identity")
    encoder = make_tiny_image_encoder(root / "encoder", image_size=16)
    pixels = torch.full((16, 16, 3), 128, dtype=torch.uint8)
    pixels[4:12, 4:12] = torch.tensor([220, 20, 20], dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(root / "reference.png")
    return {"encoder": str(encoder), "reference_image": str(root / "reference.png")}


def identity(files: dict[str, str], temporal_weight: float = 0.0) -> IdentityReward:
    reward = build_image_reward("identity", {**files, "temporal_weight": temporal_weight})
    assert isinstance(reward, IdentityReward)
    return reward


def test_the_reference_scores_one_and_others_less_with_a_gradient_to_the_pixels(files: dict[str, str]) -> None:
    reward = identity(files)
    assert not any(p.requires_grad for p in reward.parameters())
    reference = load_image(files["reference_image"])
    images = torch.stack([reference, reference.flip(-1).roll(3, dims=1), torch.rand(3, 16, 16)]).requires_grad_()
    scores = reward(images, [""] * 3)
    assert scores[0].item() == pytest.approx(1.0, abs=1e-5)
    assert scores[1].item() < 1 - 1e-4 and scores[2].item() < 1 - 1e-4
    scores[1:].sum().backward()
    assert images.grad[1:].abs().sum() > 0
    bigger = torch.nn.functional.interpolate(images.detach(), size=32, mode="nearest")  # resized to the encoder's
    assert reward(bigger, [""] * 3)[0].item() == pytest.approx(1.0, abs=1e-5)


def test_a_video_scores_its_frames_mean_and_weighted_temporal_consistency(files: dict[str, str]) -> None:
    torch.manual_seed(0)
    video = torch.rand(2, 3, 3, 16, 16)  # 2 videos of 3 frames
    plain, weighted = identity(files), identity(files, temporal_weight=0.5)
    frames = plain.embed(video.flatten(0, 1)).view(2, 3, -1)
    similarity = (frames @ plain.reference[0]).mean(dim=1)
    consistency = torch.stack([(frames[:, i] * frames[:, i + 1]).sum(-1) for i in range(2)]).mean(dim=0)
    assert torch.allclose(plain(video, ["", ""]), similarity, atol=1e-6)
    assert torch.allclose(weighted(video, ["", ""]), similarity + 0.5 * consistency, atol=1e-6)
    steady = load_image(files["reference_image"]).expand(1, 4, 3, 16, 16)
    assert weighted(steady, [""]).item() == pytest.approx(1.5, abs=1e-5)


def test_an_image_reward_scores_a_video_by_its_frames_mean() -> None:
    red, black = torch.tensor([1.0, 0, 0]).view(3, 1, 1).expand(3, 2, 2), torch.zeros(3, 2, 2)
    video = torch.stack([torch.stack([red, black, red, red]), torch.stack([black] * 4)])
    assert build_image_reward("redness")(video, ["a", "b"]).tolist() == [0.75, 0]


def test_the_identity_reward_is_chosen_in_yaml_and_its_fields_are_checked(
    valid: dict[str, Any],  # noqa: F811
    files: dict[str, str],
) -> None:
    config = reward_fl(valid, reward__name="identity", reward__kwargs={**files, "temporal_weight": 0.5})
    assert config.reward.kwargs["temporal_weight"] == 0.5
    cases = {
        "reward.kwargs.temporal_weight=-1": {**files, "temporal_weight": -1},
        "reward.kwargs.reference_image='/no/face.png' is not a file": {**files, "reference_image": "/no/face.png"},
        "reward.kwargs.encoder='/no/encoder' is neither a local directory nor a hub id": {
            **files,
            "encoder": "/no/encoder",
        },
        "reward.kwargs.encoder is required": {"reference_image": files["reference_image"]},
        "reward.kwargs.weight": {**files, "weight": 1},
    }
    for message, kwargs in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            reward_fl(valid, reward__name="identity", reward__kwargs=kwargs)
