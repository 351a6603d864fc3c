"""Before/after samples on disk: an image grid as PNG, and for video also an animated GIF of the grids frame by
frame (the PNG then shows each clip's middle frame)."""

from __future__ import annotations

from pathlib import Path

import torch

from roll.pipeline.diffusion.image_grid import image_grid, save_image_grid


def save_video_gif(videos: torch.Tensor, columns: int, path: str | Path, frame_ms: int = 250) -> Path:
    """Write videos `[N, F, 3, H, W]` in [0, 1] as one animated GIF at `path` (each frame an `image_grid` of the
    videos' frames, looping); return it."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = [
        Image.fromarray((image_grid(videos[:, index], columns) * 255).round().byte().numpy())
        for index in range(videos.shape[1])
    ]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=frame_ms, loop=0)
    return path


def save_samples(samples: torch.Tensor, columns: int, log_dir: Path, name: str) -> Path:
    """`<log_dir>/<name>.png` of images `[N, 3, H, W]`, or of videos' middle frames plus `<name>.gif` for videos
    `[N, F, 3, H, W]`; returns the PNG."""
    if samples.dim() == 5:
        save_video_gif(samples, columns, log_dir / f"{name}.gif")
        samples = samples[:, samples.shape[1] // 2]
    return save_image_grid(samples, columns, log_dir / f"{name}.png")
