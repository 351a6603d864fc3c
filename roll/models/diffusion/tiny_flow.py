"""Tiny flow-matching text-to-image and text-to-video models, built locally for tests and CPU demonstrations.

`tiny-diffusion://sd3` writes the directory layout of a diffusers Stable Diffusion 3 checkpoint
(`model_index.json` naming `StableDiffusion3Pipeline`, an `SD3Transformer2DModel`, an `AutoencoderKL`, a
`FlowMatchEulerDiscreteScheduler`, two `CLIPTextModelWithProjection` and a `T5EncoderModel` with their
tokenizers); `tiny-diffusion://wan` writes a Wan checkpoint's (`WanPipeline`: a `WanTransformer3DModel` over
frames, the video VAE `AutoencoderKLWan`, a `UMT5EncoderModel`). Both load through
`DiffusionPipeline.from_pretrained`, as SD3.5 or Wan2.2 do. Every tokenizer is the word-level one over
`TINY_WORDS`; the weights are random (the demonstration's warm start trains the VAE and the transformer).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from roll.models.build_cache import read_marker, write_marker
from roll.models.diffusion.tiny_diffusion import SPEC_MARKER, build_word_tokenizer
from roll.models.tiny import save_on_any_rank

_BUILD_VERSION = 1
TOKENIZER_CLASS = ["transformers", "PreTrainedTokenizerFast"]


@dataclass(frozen=True)
class _TinyFlowShape:
    """What every tiny flow model has: `image_size`² RGB pixels, a VAE halving them into `latent_channels`, a
    transformer of `layers` blocks of `heads` x `head_dim`, a text encoder of `text_hidden_size` reading up to
    `max_prompt_tokens`."""

    image_size: int = 16
    latent_channels: int = 4
    layers: int = 2
    heads: int = 2
    head_dim: int = 32
    text_hidden_size: int = 16
    max_prompt_tokens: int = 8

    def __post_init__(self) -> None:
        if self.image_size % 4 or self.image_size < 4:
            raise ValueError(f"image_size={self.image_size} must be a multiple of 4 (the VAE halves it, patches of 2)")


@dataclass(frozen=True)
class TinySD3Spec(_TinyFlowShape):
    """An SD3-family image model: joint transformer blocks over 2x2 latent patches."""


@dataclass(frozen=True)
class TinyWanSpec(_TinyFlowShape):
    """A Wan-family video model: `frames` RGB frames, a causal video VAE halving space and time (`frames` = 1 + 2k),
    transformer blocks over 1x2x2 latent patches."""

    frames: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.frames % 2 != 1:
            raise ValueError(f"frames={self.frames} must be odd: the causal VAE keeps the first and halves the rest")


TinyFlowSpec = TinySD3Spec | TinyWanSpec


def tiny_flow_identity(spec: TinyFlowSpec, seed: int) -> dict[str, object]:
    """What a tiny flow model's build marker vouches for: the builder's version, the family, the spec and the seed."""
    return {"version": _BUILD_VERSION, "family": type(spec).__name__, "spec": asdict(spec), "seed": seed}


def _clip_encoder(spec: TinyFlowSpec, vocab: int) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=vocab,
            hidden_size=spec.text_hidden_size,
            intermediate_size=2 * spec.text_hidden_size,
            projection_dim=spec.text_hidden_size,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=spec.max_prompt_tokens,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=2,
        )
    )


def _sd3_modules(spec: TinySD3Spec, vocab: int) -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    latent_size = spec.image_size // 2
    text = spec.text_hidden_size
    return {
        "text_encoder": _clip_encoder(spec, vocab),
        "text_encoder_2": _clip_encoder(spec, vocab),
        "text_encoder_3": T5EncoderModel(
            T5Config(vocab_size=vocab, d_model=2 * text, d_kv=8, d_ff=4 * text, num_layers=1, num_heads=2)
        ),
        "vae": AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            latent_channels=spec.latent_channels,
            norm_num_groups=4,
            sample_size=spec.image_size,
            shift_factor=0.0,
            scaling_factor=1.0,
        ),
        # The pipeline joins the two CLIP encoders' states (2 x text) and pads them to T5's width (2 x text).
        "transformer": SD3Transformer2DModel(
            sample_size=latent_size,
            patch_size=2,
            in_channels=spec.latent_channels,
            out_channels=spec.latent_channels,
            num_layers=spec.layers,
            attention_head_dim=spec.head_dim,
            num_attention_heads=spec.heads,
            joint_attention_dim=2 * text,
            caption_projection_dim=spec.heads * spec.head_dim,
            pooled_projection_dim=2 * text,
            pos_embed_max_size=latent_size // 2,
        ),
    }


def _wan_modules(spec: TinyWanSpec, vocab: int) -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    text = spec.text_hidden_size
    return {
        "text_encoder": UMT5EncoderModel(
            UMT5Config(vocab_size=vocab, d_model=text, d_kv=8, d_ff=2 * text, num_layers=1, num_heads=2)
        ),
        "vae": AutoencoderKLWan(
            base_dim=8,
            z_dim=spec.latent_channels,
            dim_mult=[1, 2],
            num_res_blocks=1,
            temperal_downsample=[True],
            latents_mean=[0.0] * spec.latent_channels,
            latents_std=[1.0] * spec.latent_channels,
            scale_factor_temporal=2,
            scale_factor_spatial=2,
        ),
        "transformer": WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=spec.heads,
            attention_head_dim=spec.head_dim,
            in_channels=spec.latent_channels,
            out_channels=spec.latent_channels,
            text_dim=text,
            freq_dim=32,
            ffn_dim=2 * spec.heads * spec.head_dim,
            num_layers=spec.layers,
            rope_max_seq_len=64,
        ),
    }


def make_tiny_flow(output_dir: str | Path, spec: TinyFlowSpec, seed: int = 0) -> Path:
    """Save a seeded random tiny flow-matching model of `spec`'s family (see the module) in `output_dir`; return it.

    A directory already built, whole, with the same spec and seed is returned as it is.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    path = Path(output_dir)
    identity = tiny_flow_identity(spec, seed)
    if read_marker(path, SPEC_MARKER) == identity:
        return path
    tokenizer = build_word_tokenizer(spec.max_prompt_tokens)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(spec, TinySD3Spec):
            modules, pipeline, tokenizers = _sd3_modules(spec, len(tokenizer)), "StableDiffusion3Pipeline", 3
        else:
            modules, pipeline, tokenizers = _wan_modules(spec, len(tokenizer)), "WanPipeline", 1
    (path / SPEC_MARKER).unlink(missing_ok=True)  # an interrupted rebuild is never mistaken for the previous build
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, object] = {"_class_name": pipeline, "_diffusers_version": _diffusers_version()}
    for name, module in modules.items():
        library = "diffusers" if name in ("vae", "transformer") else "transformers"
        index[name] = [library, type(module).__name__]
        if library == "diffusers":
            module.save_pretrained(path / name)
        else:
            save_on_any_rank(module, path / name)
    for number in range(1, tokenizers + 1):
        name = "tokenizer" if number == 1 else f"tokenizer_{number}"
        tokenizer.save_pretrained(path / name)
        index[name] = TOKENIZER_CLASS
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).save_pretrained(path / "scheduler")
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    if pipeline == "StableDiffusion3Pipeline":
        index |= {"image_encoder": [None, None], "feature_extractor": [None, None]}
    else:
        index |= {"transformer_2": [None, None], "boundary_ratio": None, "expand_timesteps": False}
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    write_marker(path, SPEC_MARKER, identity)
    return path


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__
