"""Image grids as PNG: one row per prompt, one column per sample, pixels enlarged so small images stay legible."""

from __future__ import annotations

from pathlib import Path

import torch


def image_grid(images: torch.Tensor, columns: int, scale: int = 4, gap: int = 1) -> torch.Tensor:
    """Images `[N, 3, H, W]` in [0, 1] laid out `columns` per row, each enlarged `scale` times (nearest), with a
    grey `gap` between them; returns `[rows*(H*scale+gap)+gap, ..., 3]`."""
    count, _, height, width = images.shape
    rows = -(-count // columns)
    cell_h, cell_w = height * scale + gap, width * scale + gap
    grid = torch.full((rows * cell_h + gap, columns * cell_w + gap, 3), 0.5)
    big = images.clamp(0, 1).repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3).permute(0, 2, 3, 1)
    for index, image in enumerate(big):
        row, column = divmod(index, columns)
        top, left = gap + row * cell_h, gap + column * cell_w
        grid[top : top + height * scale, left : left + width * scale] = image
    return grid


def save_image_grid(images: torch.Tensor, columns: int, path: str | Path) -> Path:
    """Write `image_grid(images, columns)` as a PNG at `path`; return it."""
    from matplotlib import image as mpl_image  # imported on use: only the driver writes grids

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mpl_image.imsave(path, image_grid(images, columns).numpy())
    return path
