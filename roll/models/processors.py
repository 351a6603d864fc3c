"""The processor of a vision-language checkpoint (Qwen2.5-VL family): its chat template, tokenizer and image
processor, loaded from the checkpoint's own files.

transformers builds a Qwen2.5-VL processor with a video processor, which needs torchvision; the CPU stack has no
torchvision that matches its torch (see /work/shared/DESIGN.md), so where AutoProcessor cannot build one the same
checkpoint is loaded as an image-only processor: the same class, image processor, tokenizer and template, without
videos. Images work the same either way.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, ProcessorMixin, Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from roll.models.tiny import resolve_model_path

# Qwen's vision tokens by role, as the tokenizer spells them.
VISION_TOKENS = {
    "vision_start": "<|vision_start|>",
    "image": "<|image_pad|>",
    "vision_end": "<|vision_end|>",
    "video": "<|video_pad|>",
}
# The model types whose checkpoints roll runs with images.
VISION_LANGUAGE_MODEL_TYPES = ("qwen2_5_vl",)


class ImageOnlyQwenProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor with no video processor (which transformers builds only with torchvision)."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any
    ) -> None:
        self.image_token, self.video_token = VISION_TOKENS["image"], VISION_TOKENS["video"]
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def image_only_processor(
    tokenizer: PreTrainedTokenizerBase, max_pixels: int, chat_template: str, min_pixels: int = 28 * 28
) -> ImageOnlyQwenProcessor:
    """A Qwen2.5-VL processor for `tokenizer` whose image processor keeps between `min_pixels` and `max_pixels`."""
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return ImageOnlyQwenProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def is_vision_language(model_path: str) -> bool:
    """Whether the checkpoint at `model_path` (a local directory or tiny:// reference) is a vision-language model
    roll feeds images to."""
    from roll.models.tiny_vlm import VLM_ARCH  # imported here: tiny_vlm builds on this module

    if model_path.startswith(f"tiny://{VLM_ARCH}"):
        return True
    if model_path.startswith("tiny://"):
        return False
    config_file = Path(resolve_model_path(model_path)).expanduser() / "config.json"
    if not config_file.is_file():
        return False
    # Read as JSON, not AutoConfig: a directory holding a tokenizer beside a partial config is no VLM, not an error.
    return json.loads(config_file.read_text()).get("model_type") in VISION_LANGUAGE_MODEL_TYPES


def freeze_vision_tower(model: torch.nn.Module) -> None:
    """Keep the vision tower of a Qwen2.5-VL model (`model.visual`, its patch merger included) out of training."""
    for param in model.model.visual.parameters():
        param.requires_grad_(False)


def processor_for(model_path: str) -> ProcessorMixin | None:
    """The processor of `model_path` when it is a vision-language model (its rows may carry images), else None."""
    return load_processor(model_path) if is_vision_language(model_path) else None


@functools.cache
def load_processor(model_path: str) -> ProcessorMixin:
    """The processor saved with `model_path` (its chat template, tokenizer padding on the left, image processor),
    loaded once per process."""
    if model_path.startswith("tiny://"):
        from roll.models.tiny_vlm import tiny_vlm_processor

        return tiny_vlm_processor(model_path)  # the processor a tiny VLM is built with, without building the model
    path = Path(resolve_model_path(model_path)).expanduser()
    if importlib.util.find_spec("torchvision") is not None:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path, padding_side="left")
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        template = getattr(tokenizer, "chat_template", None)
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text()
        processor = ImageOnlyQwenProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor
