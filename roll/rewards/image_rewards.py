"""Image reward models for diffusion training: a registry of scorers of images (and their prompts).

A scorer is a `torch.nn.Module` subclass of `ImageReward`: `forward(images, prompts)` takes images
`[B, 3, H, W]` in [0, 1] and returns one score per image `[B]`. `differentiable` says whether the score's
gradient with respect to the pixels is meaningful: Reward FL back-propagates through it, and refuses a
scorer that declares it is not. The built-ins are analytic and run anywhere; a learned scorer (an
aesthetic predictor on CLIP features, the identity reward of `identity_reward`) is a subclass named by its
dotted path (or a short name of `NAMED_IMAGE_REWARDS`), built with the keyword arguments of the reward's
`kwargs` (for example a checkpoint path), and moved to the training device with the diffusion model. A video
`[B, F, 3, H, W]` scores the mean of its frames unless the scorer handles videos itself (`scores_video`).
"""

from __future__ import annotations

import zlib
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from roll.utils.imports import import_object


class ImageReward(torch.nn.Module):
    """A scorer of images `[B, 3, H, W]` in [0, 1] with their prompts; one score per image.

    Videos `[B, F, 3, H, W]` score the mean of their frames' scores, unless the class sets `scores_video` and
    scores them itself (for a term across frames).
    """

    differentiable: ClassVar[bool] = True
    scores_video: ClassVar[bool] = False

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any], prefix: str) -> None:
        """ValueError naming `prefix`.field when `kwargs` cannot build this reward (a class with arguments to check
        overrides it; the default accepts any)."""

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """`forward` on images; on videos, the mean over frames of `forward` unless `scores_video`."""
        if images.dim() != 5 or self.scores_video:
            return super().__call__(images, prompts)
        count, frames = images.shape[:2]
        per_frame = super().__call__(images.flatten(0, 1), [prompt for prompt in prompts for _ in range(frames)])
        return per_frame.view(count, frames).mean(dim=1)

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The score of each image `[B]`."""
        raise NotImplementedError


def encoder_pixels(images: torch.Tensor, size: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Images `[N, 3, H, W]` in [0, 1] as a vision encoder's input: resized to `size`² (bilinear, differentiable) and
    normalised by the per-channel `mean` and `std` `[1, 3, 1, 1]`."""
    pixels = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return (pixels - mean.to(pixels.dtype)) / std.to(pixels.dtype)


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


# Learned rewards by short name: their modules import transformers, so they are imported when named.
NAMED_IMAGE_REWARDS = {"identity": "roll.rewards.identity_reward.IdentityReward"}


def image_reward_class(name: str, field: str = "reward.name") -> type[ImageReward]:
    """The scorer class `name` names: a built-in, a named learned reward, or the dotted path of an `ImageReward`
    subclass."""
    if name in BUILTIN_IMAGE_REWARDS:
        return BUILTIN_IMAGE_REWARDS[name]
    if "." not in name and name not in NAMED_IMAGE_REWARDS:
        names = ", ".join([*BUILTIN_IMAGE_REWARDS, *NAMED_IMAGE_REWARDS])
        raise ValueError(
            f"{field}={name!r} is not a built-in image reward ({names}) nor the dotted path of an ImageReward subclass"
        )
    cls = import_object(NAMED_IMAGE_REWARDS.get(name, name), field)
    if not (isinstance(cls, type) and issubclass(cls, ImageReward)):
        raise ValueError(f"{field}={name!r} is not a subclass of roll.rewards.image_rewards.ImageReward")
    return cls


def build_image_reward(name: str, kwargs: dict[str, Any] | None = None) -> ImageReward:
    """The scorer `name` built with `kwargs`, frozen (its own parameters never train)."""
    reward = image_reward_class(name)(**(kwargs or {}))
    reward.requires_grad_(False)
    return reward.eval()
