"""An identity reward, like ROLL's face reward: how close a generated image's embedding is to a reference image's.

The score is the cosine similarity between an embedding network's features of the generated image and of a
reference image. A video `[B, F, 3, H, W]` scores the mean of its frames' similarities, plus `temporal_weight`
times its temporal consistency: the mean cosine similarity of consecutive frames' embeddings (a video whose
subject flickers between identities scores lower than a steady one). Everything is differentiable in the pixels.

The network (`encoder`) is a transformers vision model, by hub id or local directory: a face recogniser
exported as one, or a general vision encoder (CLIP's vision tower, DINOv2, ViT, SigLIP). Its features are the
projected image embedding when it has one, else its pooled output, else its first token. Images are resized to
the encoder's input size and normalised with the mean and standard deviation of its `preprocessor_config.json`
(CLIP's when it has none). There is no face detection or alignment: the whole image is compared, so a face model
wants the face to fill the frame. `roll.models.tiny_image_encoder` builds a small random one locally for tests.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from roll.configs.schema import check, checked_in_validate, from_dict
from roll.rewards.clip_aesthetic import CLIP_MEAN, CLIP_STD
from roll.rewards.image_rewards import ImageReward, encoder_pixels

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass
class IdentityRewardArguments:
    """`reward.kwargs` of the identity reward: the embedding network, the reference image and the video term."""

    encoder: str = field(
        default="",
        metadata=checked_in_validate("a local directory or a hub id, checked by check_identity_arguments", ""),
    )
    reference_image: str = field(
        default="", metadata=checked_in_validate("an image file, checked by check_identity_arguments", "")
    )
    # Weight of a video's temporal consistency (mean cosine similarity of consecutive frames); images have none.
    temporal_weight: float = field(default=0.0, metadata=check(ge=0))


def check_identity_arguments(kwargs: dict[str, Any], prefix: str) -> IdentityRewardArguments:
    """`kwargs` as `IdentityRewardArguments`; ValueError naming `prefix`.field and the fix when a field is unknown,
    of the wrong type or out of range, the encoder neither a model directory nor a hub id, or the image missing."""
    args = from_dict(IdentityRewardArguments, kwargs, prefix)
    encoder = Path(args.encoder)
    if not args.encoder:
        raise ValueError(f"{prefix}.encoder is required: a vision encoder's hub id or local directory")
    if encoder.is_dir() and not (encoder / "config.json").is_file():
        raise ValueError(f"{prefix}.encoder={args.encoder!r} has no config.json: give a transformers model directory")
    if not encoder.is_dir() and not HUB_ID.fullmatch(args.encoder):
        raise ValueError(
            f"{prefix}.encoder={args.encoder!r} is neither a local directory nor a hub id (owner/name): fix the path"
        )
    if not Path(args.reference_image).is_file():
        raise ValueError(
            f"{prefix}.reference_image={args.reference_image!r} is not a file: give the reference image (PNG, JPEG)"
        )
    return args


def load_image(path: str) -> torch.Tensor:
    """The RGB image at `path` as `[3, H, W]` in [0, 1]."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8)
        width, height = image.size
    return pixels.view(height, width, 3).permute(2, 0, 1).float() / 255


def load_image_encoder(encoder: str) -> tuple[torch.nn.Module, int, tuple[float, ...], tuple[float, ...]]:
    """(the model, its input size, its pixel mean and standard deviation) of the transformers vision model
    `encoder`: the class its config names (so a projection head is kept), else `AutoModel`."""
    import transformers
    from transformers.utils import cached_file

    config = transformers.AutoConfig.from_pretrained(encoder)
    architecture = (getattr(config, "architectures", None) or [""])[0]
    model_class = getattr(transformers, architecture, None) or transformers.AutoModel
    model = model_class.from_pretrained(encoder)
    vision = getattr(config, "vision_config", config)
    processor_file = cached_file(encoder, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False)
    processor = json.loads(Path(processor_file).read_text()) if processor_file else {}
    mean, std = processor.get("image_mean", CLIP_MEAN), processor.get("image_std", CLIP_STD)
    return model, int(vision.image_size), tuple(mean), tuple(std)


class IdentityReward(ImageReward):
    """Cosine similarity of each image's (or frame's) embedding to the reference image's; see the module."""

    scores_video: ClassVar[bool] = True

    def __init__(self, encoder: str, reference_image: str, temporal_weight: float = 0.0) -> None:
        super().__init__()
        self.encoder, self.size, mean, std = load_image_encoder(encoder)
        self.temporal_weight = temporal_weight
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        with torch.no_grad():
            reference = self.embed(load_image(reference_image).unsqueeze(0))
        self.register_buffer("reference", reference, persistent=False)

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any], prefix: str) -> None:
        """The kwargs are `IdentityRewardArguments` whose encoder and reference image exist."""
        check_identity_arguments(kwargs, prefix)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-length features `[N, D]` of images `[N, 3, H, W]` in [0, 1]."""
        pixels = encoder_pixels(images, self.size, self.mean, self.std)
        dtype = next(self.encoder.parameters()).dtype
        if hasattr(self.encoder, "get_image_features"):  # a two-tower model (CLIP, SigLIP): its image tower
            features = self.encoder.get_image_features(pixel_values=pixels.to(dtype))
            features = features if torch.is_tensor(features) else features.pooler_output
        else:
            output = self.encoder(pixel_values=pixels.to(dtype))
            features = getattr(output, "image_embeds", None)
            if features is None:
                features = getattr(output, "pooler_output", None)
            if features is None:
                features = output.last_hidden_state[:, 0]
        return F.normalize(features.float(), dim=-1)

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """`[B]`: images `[B, 3, H, W]` score their similarity to the reference; videos `[B, F, 3, H, W]` the mean
        over frames plus `temporal_weight` x the consecutive frames' mean similarity."""
        frames = images.unsqueeze(1) if images.dim() == 4 else images
        count, length = frames.shape[:2]
        embeddings = self.embed(frames.flatten(0, 1)).view(count, length, -1)
        score = (embeddings @ self.reference.squeeze(0)).mean(dim=1)
        if length > 1 and self.temporal_weight:
            consistency = (embeddings[:, 1:] * embeddings[:, :-1]).sum(dim=-1).mean(dim=1)
            score = score + self.temporal_weight * consistency
        return score.to(images.dtype)
