"""A tiny text-to-image diffusion model in pixel space, built locally for tests and CPU demonstrations.

The directory it writes has the layout of a diffusers text-to-image checkpoint (Stable Diffusion's, without
a VAE): `unet/` (a `UNet2DConditionModel` on RGB pixels), `scheduler/` (DDIM), `text_encoder/` (a one-layer
`CLIPTextModel`) and `tokenizer/` (a word-level tokenizer over `TINY_WORDS`), so `roll.models.diffusion.parts`
loads it exactly as it loads a real one. Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

from roll.models.build_cache import build_in_cache, read_marker, write_marker
from roll.models.tiny import save_on_any_rank

TINY_DIFFUSION_SCHEME = "tiny-diffusion://"
SPEC_MARKER = "roll_tiny_diffusion_spec.json"
PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
# The words prompts may use; others become <unk>. Enough for prompts about small coloured shapes.
TINY_WORDS = [
    "a",
    "an",
    "the",
    "of",
    "on",
    "in",
    "and",
    "with",
    "small",
    "large",
    "big",
    "tiny",
    "left",
    "right",
    "top",
    "bottom",
    "centre",
    "center",
    "middle",
    "black",
    "white",
    "red",
    "green",
    "blue",
    "yellow",
    "cyan",
    "magenta",
    "orange",
    "purple",
    "pink",
    "grey",
    "gray",
    "circle",
    "square",
    "triangle",
    "cross",
    "ring",
    "shape",
    "background",
    "image",
]
# 3: the text encoder's weights written by any rank (an entry built by rank 1 of a role had none).
_BUILD_VERSION = 3


@dataclass(frozen=True)
class TinyDiffusionSpec:
    """Shape of the tiny model: `image_size`² RGB pixels, a two-level UNet of `base_channels` and twice that."""

    image_size: int = 16
    base_channels: int = 16
    text_hidden_size: int = 32
    max_prompt_tokens: int = 8
    num_train_timesteps: int = 1000

    def __post_init__(self) -> None:
        if self.image_size % 2 or self.image_size < 4:
            raise ValueError(f"image_size={self.image_size} must be even and at least 4 (the UNet halves it once)")
        if self.base_channels % 4:
            raise ValueError(f"base_channels={self.base_channels} must be a multiple of 4 (its group norm groups)")
        if self.text_hidden_size % 8:
            raise ValueError(f"text_hidden_size={self.text_hidden_size} must be a multiple of 8 (its attention heads)")


def build_word_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over `TINY_WORDS` (lower-cased), padding every prompt to `max_length`."""
    vocab = {token: i for i, token in enumerate([PAD, UNK, EOS, *TINY_WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([PAD, UNK, EOS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, unk_token=UNK, eos_token=EOS, padding_side="right"
    )
    tokenizer.model_max_length = max_length
    return tokenizer


def make_tiny_diffusion(output_dir: str | Path, spec: TinyDiffusionSpec | None = None, seed: int = 0) -> Path:
    """Save a seeded random tiny diffusion model (see the module) in `output_dir`; return it.

    A directory already built, whole, with the same spec and seed is returned as it is.
    """
    from diffusers import DDIMScheduler, UNet2DConditionModel

    spec = spec or TinyDiffusionSpec()
    path = Path(output_dir)
    identity = tiny_diffusion_identity(spec, seed)
    if read_marker(path, SPEC_MARKER) == identity:
        return path
    tokenizer = build_word_tokenizer(spec.max_prompt_tokens)
    channels = spec.base_channels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=spec.text_hidden_size,
                intermediate_size=2 * spec.text_hidden_size,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=spec.max_prompt_tokens,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.eos_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        )
        unet = UNet2DConditionModel(
            sample_size=spec.image_size,
            in_channels=3,
            out_channels=3,
            block_out_channels=(channels, 2 * channels),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=spec.text_hidden_size,
            attention_head_dim=8,
            norm_num_groups=4,
        )
    scheduler = DDIMScheduler(
        num_train_timesteps=spec.num_train_timesteps,
        beta_schedule="squaredcos_cap_v2",
        clip_sample=False,
        set_alpha_to_one=True,
    )
    (path / SPEC_MARKER).unlink(missing_ok=True)  # an interrupted rebuild is never mistaken for the previous build
    path.mkdir(parents=True, exist_ok=True)
    unet.save_pretrained(path / "unet")
    save_on_any_rank(text_encoder, path / "text_encoder")
    tokenizer.save_pretrained(path / "tokenizer")
    scheduler.save_pretrained(path / "scheduler")
    write_marker(path, SPEC_MARKER, identity)
    return path


def tiny_diffusion_identity(spec: TinyDiffusionSpec, seed: int) -> dict[str, object]:
    """What a tiny diffusion model's build marker vouches for: the build's version, the spec and the seed."""
    return {"version": _BUILD_VERSION, "spec": asdict(spec), "seed": seed}


def tiny_spec_class(kind: str) -> type:
    """The spec dataclass of tiny model `kind`: `unet` (DDIM, pixels), `sd3` or `wan` (flow matching, `tiny_flow`)."""
    from roll.models.diffusion.tiny_flow import TinySD3Spec, TinyWanSpec

    kinds = {"": TinyDiffusionSpec, "unet": TinyDiffusionSpec, "sd3": TinySD3Spec, "wan": TinyWanSpec}
    if kind not in kinds:
        raise ValueError(f"tiny diffusion model {kind!r} is not one of: unet, sd3, wan")
    return kinds[kind]


def parse_tiny_diffusion(reference: str) -> tuple[Any, int]:
    """The spec and seed a `tiny-diffusion://unet?image_size=16&base_channels=16&seed=0` reference names (or
    `tiny-diffusion://sd3?...`, `tiny-diffusion://wan?frames=5&...`: the flow-matching models of `tiny_flow`)."""
    kind, _, query = reference[len(TINY_DIFFUSION_SCHEME) :].partition("?")
    try:
        spec_class = tiny_spec_class(kind)
    except ValueError as exc:
        raise ValueError(f"{reference!r}: {exc}") from None
    fields: dict[str, int] = {}
    seed = 0
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key != "seed" and key not in spec_class.__dataclass_fields__:
            valid = ", ".join(["seed", *spec_class.__dataclass_fields__])
            raise ValueError(f"{reference!r}: unknown tiny diffusion option {key!r}; valid: {valid}")
        if not value.isdigit():
            raise ValueError(f"{reference!r}: option {key}={value!r} must be a whole number")
        if key == "seed":
            seed = int(value)
        else:
            fields[key] = int(value)
    return spec_class(**fields), seed


def resolve_diffusion_path(model_name_or_path: str, cache_dir: str | None = None) -> str:
    """A local model directory for `model_name_or_path`; `tiny-diffusion://...` references are built on first use.

    Built once under `cache_dir` (default `$ROLL_CACHE_DIR` or `~/.cache/roll`) under a file lock, so
    concurrent workers build it once, and renamed into place when whole. Other values pass through.
    """
    if not model_name_or_path.startswith(TINY_DIFFUSION_SCHEME):
        return model_name_or_path
    spec, seed = parse_tiny_diffusion(model_name_or_path)
    if isinstance(spec, TinyDiffusionSpec):
        build = lambda path: make_tiny_diffusion(path, spec, seed=seed)  # noqa: E731
        return build_in_cache(
            "tiny_diffusion", spec, seed, build, (SPEC_MARKER, tiny_diffusion_identity(spec, seed)), cache_dir
        )
    from roll.models.diffusion.tiny_flow import make_tiny_flow, tiny_flow_identity

    build = lambda path: make_tiny_flow(path, spec, seed=seed)  # noqa: E731
    kind = f"tiny_flow_{type(spec).__name__}"
    return build_in_cache(kind, spec, seed, build, (SPEC_MARKER, tiny_flow_identity(spec, seed)), cache_dir)
