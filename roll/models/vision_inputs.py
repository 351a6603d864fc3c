"""Images kept with their rows through a DataProto, and handed to a vision-language model's forward pass.

Qwen2.5-VL takes the images of a whole batch as one tensor of flattened patches (`pixel_values` `[patches, dim]`)
and their grids (`image_grid_thw` `[images, 3]`), in row order. A batch is split, padded, repeated and reordered
by rows, so each row keeps its own: the non-tensor columns `pixel_values` and `image_grid_thw` hold one numpy
array per row (empty for a row without images), and `model_image_kwargs` concatenates the rows of a micro-batch
when the model runs. The model then computes its multimodal rotary positions (`get_rope_index`) from the ids, the
attention mask and the grids: image tokens take (time, height, width) positions, text tokens after them continue
from the image's extent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from roll.distributed.scheduler.protocol import DataProto

PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"
IMAGE_KEYS = (PIXEL_VALUES, IMAGE_GRID_THW)


def image_columns(pixel_values: Sequence[np.ndarray | None], grids: Sequence[np.ndarray | None]) -> dict[str, list]:
    """The non-tensor columns of rows' images; a row without images gets empty arrays."""
    dim = next((p.shape[1] for p in pixel_values if p is not None and p.ndim == 2), 0)
    empty_pixels, empty_grid = np.zeros((0, dim), dtype=np.float32), np.zeros((0, 3), dtype=np.int64)
    return {
        PIXEL_VALUES: [empty_pixels if p is None else p for p in pixel_values],
        IMAGE_GRID_THW: [empty_grid if g is None else g for g in grids],
    }


def has_images(batch: DataProto) -> bool:
    """Whether `batch` carries image columns (any row may still have no image)."""
    return PIXEL_VALUES in batch.non_tensor_batch


def _unwrapped(model: Any) -> Any:
    """The module inside engines that wrap one (DeepSpeed's engine forwards attributes, its `config` is its own)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def image_token_id(model: Any) -> int | None:
    """The image token id of the Hugging Face model inside `model` (an engine or wrapper), None for a text model."""
    config = getattr(_unwrapped(model), "config", None)
    return getattr(config, "image_token_id", None)


def vision_token_ids(model: Any) -> list[int]:
    """The ids of the vision tokens of the model inside `model` (image, video, vision start and end), which only a
    processor places: generation never samples them. Empty for a text model."""
    if image_token_id(model) is None:
        return []
    config = _unwrapped(model).config
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [getattr(config, name) for name in names if getattr(config, name, None) is not None]


def model_image_kwargs(batch: DataProto, input_ids: torch.Tensor, token_id: int, device: Any) -> dict[str, Any]:
    """The keyword arguments that give a Qwen2.5-VL forward or `generate` call the images of `batch`'s rows:
    `pixel_values`, `image_grid_thw` and `mm_token_type_ids` (1 on image tokens); {} when no row has an image.

    ValueError when a row's image tokens do not match its grids (ids cut short, or images of another row).
    """
    grids = [np.asarray(g, dtype=np.int64).reshape(-1, 3) for g in batch.non_tensor_batch[IMAGE_GRID_THW]]
    if not any(len(g) for g in grids):
        return {}
    pixels = [np.asarray(p, dtype=np.float32) for p in batch.non_tensor_batch[PIXEL_VALUES]]
    token_type = (input_ids == token_id).int()
    expected = [int(g.prod(-1).sum()) // 4 for g in grids]  # Qwen merges 2 x 2 patches into one token
    found = token_type.sum(-1).tolist()
    if expected != found:
        raise ValueError(f"rows hold {found} image tokens but their image grids give {expected}")
    return {
        PIXEL_VALUES: torch.from_numpy(np.concatenate([p for p in pixels if len(p)])).to(device),
        IMAGE_GRID_THW: torch.from_numpy(np.concatenate([g for g in grids if len(g)])).to(device),
        "mm_token_type_ids": token_type.to(device),
    }
