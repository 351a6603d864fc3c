"""Image reward models for diffusion training: a registry of scorers of images (and their prompts).

A scorer is a `torch.nn.Module` subclass of `ImageReward`: `forward(images, prompts)` takes images
`[B, 3, H, W]` in [0, 1] and returns one score per image `[B]`. `differentiable` says whether the score's
gradient with respect to the pixels is meaningful: Reward FL back-propagates through it, and refuses a
scorer that declares it is not. The built-ins are analytic and run anywhere; a learned scorer (an
aesthetic predictor on CLIP features, a face-identity model) is a subclass named by its dotted path, built
with the keyword arguments of the reward's `kwargs` (for example a checkpoint path), and moved to the
training device with the diffusion model.
"""

from __future__ import annotations

import zlib
from typing import Any, ClassVar

import torch

from roll.utils.imports import import_object


class ImageReward(torch.nn.Module):
    """A scorer of images `[B, 3, H, W]` in [0, 1] with their prompts; one score per image."""

    differentiable: ClassVar[bool] = True

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The score of each image `[B]`."""
        raise NotImplementedError


class Redness(ImageReward):
    """How red the image is: the mean over pixels of max(0, R - max(G, B)). A black background scores 0, a
    pure red image 1."""

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Mean red excess per image."""
        red, green, blue = images.unbind(dim=1)
        return torch.relu(red - torch.maximum(green, blue)).mean(dim=(1, 2))


class Brightness(ImageReward):
    """Mean luminance (Rec. 601 weights): 0 for black, 1 for white."""

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Mean luminance per image."""
        weights = images.new_tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
        return (images * weights).sum(dim=1).mean(dim=(1, 2))


class Colourfulness(ImageReward):
    """Mean saturation: the mean over pixels of max(R, G, B) - min(R, G, B); 0 for greys, 1 for pure hues."""

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Mean channel spread per image."""
        return (images.amax(dim=1) - images.amin(dim=1)).mean(dim=(1, 2))


class Compressibility(ImageReward):
    """How well the image compresses (DDPO's compressibility): minus its zlib size in kilobytes, 8-bit pixels.

    Not differentiable (the pixels are quantised and compressed): a policy-gradient method needs it.
    """

    differentiable = False

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Minus the compressed size (kB) of each image."""
        pixels = (images.detach().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        sizes = [len(zlib.compress(image.tobytes(), 9)) / 1000 for image in pixels]
        return torch.tensor([-size for size in sizes], dtype=images.dtype, device=images.device)


BUILTIN_IMAGE_REWARDS: dict[str, type[ImageReward]] = {
    "redness": Redness,
    "brightness": Brightness,
    "colourfulness": Colourfulness,
    "compressibility": Compressibility,
}


def image_reward_class(name: str, field: str = "reward.name") -> type[ImageReward]:
    """The scorer class `name` names: a built-in, or the dotted path of an `ImageReward` subclass."""
    if name in BUILTIN_IMAGE_REWARDS:
        return BUILTIN_IMAGE_REWARDS[name]
    if "." not in name:
        raise ValueError(
            f"{field}={name!r} is not a built-in image reward ({', '.join(BUILTIN_IMAGE_REWARDS)}) nor the dotted "
            "path of an ImageReward subclass"
        )
    cls = import_object(name, field)
    if not (isinstance(cls, type) and issubclass(cls, ImageReward)):
        raise ValueError(f"{field}={name!r} is not a subclass of roll.rewards.image_rewards.ImageReward")
    return cls


def build_image_reward(name: str, kwargs: dict[str, Any] | None = None) -> ImageReward:
    """The scorer `name` built with `kwargs`, frozen (its own parameters never train)."""
    reward = image_reward_class(name)(**(kwargs or {}))
    reward.requires_grad_(False)
    return reward.eval()
