"""A diffusers text-to-image directory as its parts: denoiser, scheduler, text encoder, tokenizer, optional VAE.

The layout is Stable Diffusion's (`unet/`, `scheduler/`, `text_encoder/`, `tokenizer/`, and `vae/` for a
model that denoises latents); the tiny model (`tiny_diffusion`) writes the same layout without `vae/`.
The scheduler is loaded as DDIM whatever the directory names, since Reward FL samples deterministically.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, CLIPTextModel, PreTrainedTokenizerBase

from roll.models.diffusion.tiny_diffusion import resolve_diffusion_path

REQUIRED_PARTS = ("unet", "scheduler", "text_encoder", "tokenizer")
# Parts a Reward FL run may train; the others stay frozen.
TRAINABLE_PARTS = ("unet", "text_encoder")


@dataclass
class DiffusionParts:
    """The loaded parts of one text-to-image diffusion model and the directory they came from."""

    unet: torch.nn.Module
    scheduler: Any
    text_encoder: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    vae: torch.nn.Module | None
    source_dir: Path


def check_diffusion_dir(path: str | Path) -> list[str]:
    """The parts missing from a diffusers text-to-image directory (empty: it has every required part)."""
    root = Path(path)
    return [part for part in REQUIRED_PARTS if not (root / part).is_dir()]


def load_diffusion_scheduler(model_name_or_path: str) -> Any:
    """The scheduler of `model_name_or_path` (a directory or a `tiny-diffusion://` reference), as DDIM."""
    from diffusers import DDIMScheduler

    return DDIMScheduler.from_pretrained(resolve_diffusion_path(model_name_or_path), subfolder="scheduler")


def load_diffusion_parts(model_name_or_path: str, dtype: torch.dtype = torch.float32) -> DiffusionParts:
    """Load every part of `model_name_or_path` (a directory or a `tiny-diffusion://` reference) on the CPU."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    root = Path(resolve_diffusion_path(model_name_or_path))
    missing = check_diffusion_dir(root)
    if missing:
        raise FileNotFoundError(f"{root} is not a diffusers text-to-image directory: it has no {', '.join(missing)}/")
    vae = AutoencoderKL.from_pretrained(root, subfolder="vae", torch_dtype=dtype) if (root / "vae").is_dir() else None
    return DiffusionParts(
        unet=UNet2DConditionModel.from_pretrained(root, subfolder="unet", torch_dtype=dtype),
        scheduler=load_diffusion_scheduler(str(root)),
        text_encoder=CLIPTextModel.from_pretrained(root / "text_encoder", dtype=dtype),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        vae=vae,
        source_dir=root,
    )


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> dict[str, torch.Tensor]:
    """`input_ids` and `attention_mask` of `prompts`, padded to the tokenizer's `model_max_length`."""
    encoded = tokenizer(
        prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    )
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def save_diffusion_parts(
    parts: DiffusionParts, output_dir: str | Path, state_dicts: dict[str, dict[str, torch.Tensor]] | None = None
) -> Path:
    """Write `parts` as a diffusers directory; `state_dicts` by part name replace those parts' weights (full tensors
    gathered from a sharded engine). Parts without weights of their own here are copied from the source."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_dicts = state_dicts or {}
    if "unet" in state_dicts:  # diffusers' save_pretrained writes the module's own (here: sharded) state
        from safetensors.torch import save_file

        (out / "unet").mkdir(exist_ok=True)
        parts.unet.save_config(out / "unet")
        weights = {name: tensor.contiguous() for name, tensor in state_dicts["unet"].items()}
        save_file(weights, str(out / "unet" / "diffusion_pytorch_model.safetensors"))
    else:
        parts.unet.save_pretrained(out / "unet")
    parts.text_encoder.save_pretrained(out / "text_encoder", state_dict=state_dicts.get("text_encoder"))
    parts.tokenizer.save_pretrained(out / "tokenizer")
    parts.scheduler.save_pretrained(out / "scheduler")
    if parts.vae is not None:
        shutil.copytree(parts.source_dir / "vae", out / "vae", dirs_exist_ok=True)
    return out
