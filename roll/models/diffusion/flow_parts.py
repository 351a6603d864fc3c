"""A diffusers flow-matching pipeline (Stable Diffusion 3 / 3.5 for images, Wan 2.x for video) as its parts.

Everything loads through `DiffusionPipeline.from_pretrained`, so a hub id, a local checkpoint and a
`tiny-diffusion://sd3` or `tiny-diffusion://wan` reference take the same path; the text encoders are loaded first,
in the order of their names, the same on every rank (`transformers_models`). The sampler is a
`FlowMatchEulerDiscreteScheduler` built from the directory's scheduler config whatever class it names (Wan's
checkpoints name UniPC with a `flow_shift`), since Reward FL and Flow-GRPO step the flow by Euler.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from roll.models.diffusion.tiny_diffusion import TINY_DIFFUSION_SCHEME, resolve_diffusion_path

# The transformer classes a flow model may have, and whether it makes images or video.
FLOW_TRANSFORMERS = {"SD3Transformer2DModel": "image", "WanTransformer3DModel": "video"}
TINY_FLOW_KINDS = {"sd3": "image", "wan": "video"}
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass
class FlowParts:
    """The loaded pipeline (its prompt encoding is used as diffusers wrote it), its trainable transformer, the
    VAE, the Euler scheduler, and whether it makes `image`s or `video`."""

    pipeline: Any
    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler: Any
    family: Literal["image", "video"]

    @property
    def named_text_encoders(self) -> dict[str, torch.nn.Module]:
        """The pipeline's text encoders (frozen) by component name, in the order of their names."""
        names = ("text_encoder", "text_encoder_2", "text_encoder_3")
        return {name: module for name in names if (module := getattr(self.pipeline, name, None)) is not None}

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's text encoders (frozen)."""
        return list(self.named_text_encoders.values())


def flow_family(model: str) -> Literal["image", "video"] | None:
    """`image` or `video` for a flow-matching model (a tiny reference or a local diffusers directory whose
    transformer is one of `FLOW_TRANSFORMERS`); None for anything else (a UNet model, a hub id, no directory)."""
    if model.startswith(TINY_DIFFUSION_SCHEME):
        kind = model[len(TINY_DIFFUSION_SCHEME) :].partition("?")[0]
        return TINY_FLOW_KINDS.get(kind)  # type: ignore[return-value]
    config = Path(model) / "transformer" / "config.json"
    if not (Path(model) / "model_index.json").is_file() or not config.is_file():
        return None
    return FLOW_TRANSFORMERS.get(json.loads(config.read_text()).get("_class_name"))  # type: ignore[return-value]


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a Hugging Face hub id (`owner/name`) and is not a local path."""
    return bool(HUB_ID.fullmatch(model)) and not Path(model).exists()


def euler_scheduler(config: dict[str, Any]) -> Any:
    """A `FlowMatchEulerDiscreteScheduler` from any flow scheduler's config (`shift`, or UniPC's `flow_shift`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    shift = config.get("shift") or config.get("flow_shift") or 1.0
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=config.get("num_train_timesteps", 1000),
        shift=shift,
        use_dynamic_shifting=False,
    )


def local_scheduler_config(model: str) -> dict[str, Any] | None:
    """The scheduler config of a tiny reference or a local directory; None for a hub id (not fetched here)."""
    if model.startswith(TINY_DIFFUSION_SCHEME):
        return {"num_train_timesteps": 1000, "shift": 1.0}
    path = Path(model) / "scheduler" / "scheduler_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_flow_parts(model_name_or_path: str, dtype: torch.dtype = torch.float32) -> FlowParts:
    """Load a flow-matching pipeline (hub id, directory or tiny reference) on the CPU, its transformers models first
    in the order of their names (`transformers_models`)."""
    from diffusers import DiffusionPipeline

    path = resolve_diffusion_path(model_name_or_path)
    folder = Path(path if Path(path).is_dir() else DiffusionPipeline.download(path))
    pipeline = DiffusionPipeline.from_pretrained(folder, dtype=dtype, **transformers_models(folder, dtype))
    family = FLOW_TRANSFORMERS.get(type(pipeline.transformer).__name__)
    if family is None:
        raise ValueError(
            f"{model_name_or_path}: transformer {type(pipeline.transformer).__name__} is not one of "
            f"{', '.join(FLOW_TRANSFORMERS)}"
        )
    pipeline.set_progress_bar_config(disable=True)
    return FlowParts(
        pipeline, pipeline.transformer, pipeline.vae, euler_scheduler(dict(pipeline.scheduler.config)), family
    )


def transformers_models(folder: Path, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The transformers models of the pipeline in `folder` (its text encoders) by component name, loaded in the order
    of their names.

    diffusers loads a pipeline's components in the order of a set of names (`ConfigMixin.extract_init_dict` iterates
    the pipeline's `__init__` parameters as a set), which differs from process to process since Python salts string
    hashes per process. At ZeRO-3 transformers loads each model collectively (`zero.Init` broadcasts every parameter
    it creates, loading gathers and scatters them again), so two ranks that loaded SD3's three text encoders in
    different orders paired one encoder's collectives with another's: gloo aborted on a message of unexpected size,
    a rank waited forever, or, the two CLIP encoders having one shape, rank 1 took rank 0's weights of the other one.
    Passed to `DiffusionPipeline.from_pretrained`, they are used as they are; the other components load no model
    collectively.
    """
    import transformers

    index = json.loads((folder / "model_index.json").read_text())
    models: dict[str, torch.nn.Module] = {}
    for name in sorted(index):
        entry = index[name]
        if not (isinstance(entry, list) and entry[0] == "transformers" and (folder / name).is_dir()):
            continue
        model_class = getattr(transformers, entry[1], None)
        if isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel):
            models[name] = model_class.from_pretrained(folder / name, dtype=dtype)
    return models


def save_flow_parts(
    parts: FlowParts, output_dir: str | Path, states: dict[str, dict[str, torch.Tensor]] | None = None
) -> Path:
    """Write the pipeline as a diffusers directory; `states` by component name (full tensors gathered from a sharded
    engine: under ZeRO-3 a module's own parameters are empty partitions) replace those components' weights."""
    import transformers
    from safetensors.torch import save_file

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipeline = parts.pipeline
    pipeline.save_config(out)  # model_index.json
    states = states or {}
    for name, component in pipeline.components.items():
        if component is None or not hasattr(component, "save_pretrained"):
            continue
        state = {key: tensor.contiguous() for key, tensor in states.get(name, {}).items()}
        if not state:
            component.save_pretrained(out / name)
        elif isinstance(component, transformers.PreTrainedModel):
            component.save_pretrained(out / name, state_dict=state)
        else:
            shutil.rmtree(out / name, ignore_errors=True)  # no shard index of an earlier save may remain
            (out / name).mkdir()
            component.save_config(out / name)
            save_file(state, str(out / name / "diffusion_pytorch_model.safetensors"))
    return out
