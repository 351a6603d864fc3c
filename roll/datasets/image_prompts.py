"""Prompts with images: chat messages whose content holds image parts, processed by the model's own processor.

A row is an OpenAI/HF chat conversation (`messages`) whose user content may be a list of parts: text parts
(`{"type": "text", "text": ...}`) and image parts (`{"type": "image"}`, `{"type": "image", "image": <path>}` or
OpenAI's `{"type": "image_url", "image_url": {"url": <path or data: URL>}}`). An image part without its own image
takes the next of the row's `images` (a list of file paths, raw bytes, or a hub dataset's image column, whose
values are `{"bytes", "path"}` or PIL images). Every image is opened and checked against `data.max_images_per_prompt`
and `data.max_image_pixels` when the data is read (before any worker starts): a corrupt, missing or oversized image
is a ConfigError naming its row. The processor then renders the chat template, widens each image part to its image
tokens and gives the row's `pixel_values` and `image_grid_thw`, which stay with the row through every pass.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError
from transformers import ProcessorMixin

from roll.configs.data_config import SourceArguments
from roll.configs.schema import ConfigError
from roll.datasets.sources import Source

IMAGE_PART_TYPES = ("image", "image_url")


def open_image(value: Any) -> Image.Image:
    """An RGB image from a file path, a `data:` URL, raw bytes, a hub image value (`{"bytes", "path"}`) or a PIL
    image; OSError/ValueError when it cannot be read."""
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, dict):
        image = open_image(value["bytes"] if value.get("bytes") else value.get("path") or "")
    elif isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    elif isinstance(value, str) and value.startswith("data:"):
        image = Image.open(io.BytesIO(base64.b64decode(value.partition(",")[2])))
    elif isinstance(value, str) and value:
        image = Image.open(Path(value).expanduser())
    else:
        raise ValueError(f"{type(value).__name__} {value!r:.60} is not an image, a path or bytes")
    image.load()  # a truncated file fails here rather than inside the processor
    return image.convert("RGB")


def _part_image(part: dict[str, Any]) -> Any:
    """The image a part names itself, or None when it takes the next of the row's images."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image")


def split_images(messages: list[dict[str, Any]], images: Sequence[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """`messages` with every image part as `{"type": "image"}` (what chat templates render), and the images in the
    order their parts appear. ValueError when the parts and `images` do not match in number."""
    remaining = list(images)
    ordered: list[Any] = []
    rendered = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            if part.get("type") in IMAGE_PART_TYPES:
                named = _part_image(part)
                if named is None:
                    if not remaining:
                        raise ValueError("it has more image parts than images")
                    named = remaining.pop(0)
                ordered.append(named)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    if remaining:
        raise ValueError(f"{len(remaining)} of its images have no image part in the messages")
    return rendered, ordered


def checked_images(values: Sequence[Any], data: SourceArguments) -> list[Image.Image]:
    """The images of one row, opened; ValueError naming the image when one is unreadable or breaks a limit."""
    if len(values) > data.max_images_per_prompt:
        raise ValueError(
            f"it has {len(values)} images, more than data.max_images_per_prompt={data.max_images_per_prompt}"
        )
    images = []
    for position, value in enumerate(values):
        try:
            image = open_image(value)
        except (OSError, ValueError, UnidentifiedImageError) as exc:
            raise ValueError(f"its image {position} cannot be read ({exc})") from exc
        width, height = image.size
        if width * height > data.max_image_pixels:
            raise ValueError(
                f"its image {position} is {width}x{height} = {width * height} pixels, more than "
                f"data.max_image_pixels={data.max_image_pixels}; resize it or raise the limit"
            )
        images.append(image)
    return images


def process_image_row(
    messages: list[dict[str, Any]], images: Sequence[Image.Image], processor: ProcessorMixin, system_prompt: str = ""
) -> dict[str, Any]:
    """The prompt text (chat template, generation prompt), its ids with each image's tokens, and the images'
    `pixel_values` `[patches, dim]` (float32) and `image_grid_thw` `[images, 3]`, as numpy arrays."""
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return encode_text_and_images(text, images, processor)


def encode_text_and_images(text: str, images: Sequence[Image.Image], processor: ProcessorMixin) -> dict[str, Any]:
    """`text` with Qwen's image spans, as `process_image_row` returns it: ids with each image's tokens, pixels and
    grids."""
    # No special tokens added: the text is a whole rendered prompt, or a turn appended mid-episode.
    encoded = processor(text=[text], images=list(images) or None, return_tensors="np", add_special_tokens=False)
    dim = _patch_dim(processor)
    return {
        "prompt": text,
        "prompt_ids": encoded["input_ids"][0].tolist(),
        "pixel_values": encoded.get("pixel_values", np.zeros((0, dim))).astype(np.float32),
        "image_grid_thw": encoded.get("image_grid_thw", np.zeros((0, 3))).astype(np.int64),
    }


def _patch_dim(processor: ProcessorMixin) -> int:
    """Values per flattened patch of the processor's images (channels x temporal x patch x patch)."""
    image_processor = processor.image_processor
    return 3 * image_processor.temporal_patch_size * image_processor.patch_size**2


def encode_image_rows(
    rows: Sequence[dict[str, Any]], processor: ProcessorMixin, data: SourceArguments, source: Source
) -> list[dict[str, Any]]:
    """Each row (`messages`, `images`, `answer`, `demonstration`, `domain`) processed for the model: its prompt,
    prompt ids, pixel values and image grid, with the other columns kept. A row whose images cannot be read or
    break a limit is a ConfigError naming it."""
    encoded = []
    for index, row in enumerate(rows):
        try:
            messages, values = split_images(row["messages"], row.get("images") or [])
            images = checked_images(values, data)
        except ValueError as exc:
            raise ConfigError(f"{source.row(index)}: {exc}") from exc
        processed = process_image_row(messages, images, processor, data.system_prompt)
        encoded.append({**{k: v for k, v in row.items() if k not in ("messages", "images")}, **processed})
    return encoded
