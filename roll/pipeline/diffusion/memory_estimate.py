"""The dry run's memory estimate of a Reward FL actor rank (a UNet's or a flow-matching transformer's): every part's
weights, the ZeRO states of the parts that train, and the activations one micro-batch keeps for backward.

A diffusion model's layers are too varied for the closed forms of the decoder estimate (`dry_run.activations`),
so the parts are built from their configs under torch's `FakeTensorMode` (tensors with shapes and dtypes but no
storage, dispatched as on the CPU, so each kernel saves what it saves there: the CPU flash attention its
log-sum-exp, not the attention matrix) and the actor's real forward runs once on them, counting every distinct
tensor autograd saves for backward: the K gradient steps' denoiser passes (both halves of guidance), the
regulariser, the VAE decode, the reward network and a trained text encoder. With gradient checkpointing the
census also counts one denoiser pass, recomputed in backward while the rest is kept. The policy-gradient updates
keep one denoiser pass per step they recompute (DDPO's denoising steps, Flow-GRPO's SDE steps), DiffusionNFT's one.
The reward is built for real (its weights loaded: `from_pretrained` refuses fake tensors); the other parts load no
weights, only their configs (a flow model's through its pipeline's `model_index.json`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roll.configs.model_dir import DTYPE_BYTES
from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.dry_run.backend_ranks import RankBreakdown, reduce_buckets
from roll.pipeline.base.dry_run.model_states import (
    _DS_LIVE_KEYS,
    _DS_LIVE_PARAMETERS,
    MemoryItem,
    _share,
    _zero_block,
    optimizer_step_bytes,
    zero_model_states,
)
from roll.pipeline.diffusion.sampling import SamplingArguments, gradient_step_mask

if TYPE_CHECKING:
    from roll.pipeline.diffusion.flow_model import FlowRewardModel
    from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig
    from roll.pipeline.diffusion.reward_fl_model import RewardFLModel


@dataclass(frozen=True)
class ActorCensus:
    """What one actor rank's model holds and keeps: parameters by part (`unet`, `reference_unet`, `reward`, ...),
    how many train, the largest single tensor, and the bytes saved for backward by one micro-batch."""

    params: dict[str, int]
    trainable: int
    largest_param: int
    activations: int


def saved_bytes(run: Callable[[], Any], exclude: set[int]) -> int:
    """Bytes of the distinct tensors autograd saves for backward while `run` runs (views counted once, with their
    base), tensors whose id is in `exclude` (the parameters) left out."""
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in exclude:
            saved[id(base)] = base
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(tensor.numel() * tensor.element_size() for tensor in saved.values())


def fake_actor_model(config: RewardFLConfig, fake_mode: Any) -> RewardFLModel:
    """The actor's `RewardFLModel` with its networks built from their configs under `fake_mode` (a `FakeTensorMode`);
    the scheduler, tokenizer and reward are real."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel

    from roll.models.diffusion.parts import DiffusionParts, load_diffusion_scheduler
    from roll.models.diffusion.tiny_diffusion import resolve_diffusion_path
    from roll.models.model_providers import dtype_from_name
    from roll.pipeline.diffusion.reward_fl_model import RewardFLModel
    from roll.rewards.image_rewards import build_image_reward

    args = config.actor.model_args
    root = Path(resolve_diffusion_path(config.warm_start.base_model or args.model_name_or_path))
    unet_config = UNet2DConditionModel.load_config(root, subfolder="unet")
    text_config = CLIPTextConfig.from_pretrained(root / "text_encoder")
    vae_config = AutoencoderKL.load_config(root, subfolder="vae") if (root / "vae").is_dir() else None
    reward = build_image_reward(config.reward.name, config.reward.kwargs)
    scheduler, tokenizer = load_diffusion_scheduler(str(root)), AutoTokenizer.from_pretrained(root / "tokenizer")
    _keep_timesteps_real(scheduler)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype_from_name(args.dtype))  # fake parameters cannot be converted after they are made
    try:
        with fake_mode:
            parts = DiffusionParts(
                unet=UNet2DConditionModel.from_config(unet_config),
                scheduler=scheduler,
                text_encoder=CLIPTextModel(text_config),
                tokenizer=tokenizer,
                vae=None if vae_config is None else AutoencoderKL.from_config(vae_config),
                source_dir=root,
            )
            # LoRA adapters cannot be added to fake layers (peft swaps their tensors): the model is built without
            # them, and `census_actor` counts them apart. With LoRA the reference is the UNet without adapters.
            model = RewardFLModel(
                parts,
                reward,
                config.trainable_models,
                dataclasses.replace(args, lora_rank=0),
                config.regulariser_weight > 0 and args.lora_rank == 0,
            )
    finally:
        torch.set_default_dtype(default)
    model.sampling, model.policy = census_sampling(config.sampling, scheduler), config.policy
    return model


def _keep_timesteps_real(scheduler: Any) -> None:
    """Make `scheduler.set_timesteps` leave plain numbers even under a fake mode: the sampling loop branches on the
    timesteps' values (which steps keep their gradient, the step's previous alpha)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    set_timesteps = scheduler.set_timesteps

    def real_timesteps(*args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            set_timesteps(*args, **kwargs)
            scheduler.timesteps = scheduler.timesteps.tolist()

    scheduler.set_timesteps = real_timesteps


def fake_flow_model(config: RewardFLConfig, fake_mode: Any) -> FlowRewardModel:
    """The actor's `FlowRewardModel` with its pipeline's networks (transformer, VAE, text encoders) built from their
    configs under `fake_mode`; tokenizers, scheduler and reward are real. The configs are read as diffusers reads
    them (`model_index.json` names each component's class), from a directory or a hub id."""
    import diffusers
    from transformers import AutoConfig

    from roll.models.diffusion.flow_parts import FLOW_TRANSFORMERS, FlowParts, euler_scheduler
    from roll.models.diffusion.tiny_diffusion import resolve_diffusion_path
    from roll.models.model_providers import dtype_from_name
    from roll.pipeline.diffusion.flow_model import FlowRewardModel
    from roll.rewards.image_rewards import build_image_reward

    args = config.actor.model_args
    root = resolve_diffusion_path(config.warm_start.base_model or args.model_name_or_path)
    index = diffusers.DiffusionPipeline.load_config(root)
    components: dict[str, Any] = {}
    default, dtype = torch.get_default_dtype(), dtype_from_name(args.dtype)
    torch.set_default_dtype(dtype)  # fake parameters cannot be converted after they are made
    try:
        for name, value in index.items():
            if name.startswith("_"):
                continue
            if not isinstance(value, list):  # a pipeline option (Wan's boundary_ratio, expand_timesteps)
                components[name] = value
                continue
            library, class_name = value
            if library is None:
                components[name] = None
                continue
            component = getattr(importlib.import_module(library), class_name)
            if name.startswith(("transformer", "vae")):
                with fake_mode:
                    components[name] = component.from_config(component.load_config(root, subfolder=name))
            elif name.startswith("text_encoder"):
                encoder_config = AutoConfig.from_pretrained(root, subfolder=name)
                with fake_mode:  # in the run's dtype, as the worker loads it (not the one its config records)
                    components[name] = component._from_config(encoder_config, dtype=dtype)
            else:  # tokenizers and the scheduler
                components[name] = component.from_pretrained(root, subfolder=name)
        pipeline = getattr(diffusers, index["_class_name"])(**components)
        family = FLOW_TRANSFORMERS[type(pipeline.transformer).__name__]
        if family == "video":
            _t5_embeds_by_shape(pipeline)
        scheduler = euler_scheduler(dict(pipeline.scheduler.config))
        parts = FlowParts(pipeline, pipeline.transformer, pipeline.vae, scheduler, family)
        reward = build_image_reward(config.reward.name, config.reward.kwargs)
        # As for the UNet, LoRA adapters are counted apart (`census_actor`); with them the reference is the
        # transformer without adapters, so no copy.
        with_copy = config.regulariser_weight > 0 and args.lora_rank == 0
        with fake_mode:
            model = FlowRewardModel(parts, reward, dataclasses.replace(args, lora_rank=0), with_copy)
    finally:
        torch.set_default_dtype(default)
    model.sampling, model.policy, model.flow = config.sampling, config.policy, config.flow
    return model


def _t5_embeds_by_shape(pipeline: Any) -> None:
    """Give a Wan pipeline's T5 prompt embeddings as zeros of their shape: diffusers trims each prompt's embeddings
    to its length (a data-dependent slice, which fake tensors cannot take) and pads them back to
    `max_sequence_length`. The encoder runs without gradient, so it keeps nothing for backward."""
    width = pipeline.text_encoder.config.d_model

    def by_shape(
        prompt: str | list[str],
        num_videos_per_prompt: int = 1,
        max_sequence_length: int = 226,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        count = (1 if isinstance(prompt, str) else len(prompt)) * num_videos_per_prompt
        return torch.zeros(count, max_sequence_length, width, dtype=dtype or pipeline.text_encoder.dtype)

    pipeline._get_t5_prompt_embeds = by_shape


def census_sampling(sampling: SamplingArguments, scheduler: Any) -> SamplingArguments:
    """`sampling` cut to its gradient steps: the steps before them keep nothing for backward, and their fake passes
    would only take time. The saved tensors' shapes do not depend on the timesteps' values."""
    scheduler.set_timesteps(sampling.num_inference_steps)
    kept = sum(gradient_step_mask(scheduler.timesteps, sampling))
    return dataclasses.replace(
        sampling,
        num_inference_steps=kept,
        grad_steps=kept,
        min_timestep=0,
        max_timestep=scheduler.config.num_train_timesteps,
    )


def census_actor(config: RewardFLConfig) -> ActorCensus:
    """`ActorCensus` of the actor's model on a fake micro-batch of `per_device_train_batch_size` prompts (see the
    module): the Reward FL forward, or the update's passes of the policy-gradient algorithms (each step's
    log-probability recomputed with its gradient; the Gaussians' own few latents left out), or DiffusionNFT's one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows = config.actor.training_args.per_device_train_batch_size
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with warnings.catch_warnings():  # copying a fake denoiser for the reference reads its (absent) data pointers
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        model = fake_flow_model(config, fake_mode) if config.flow_model else fake_actor_model(config, fake_mode)
    denoiser = model.transformer if config.flow_model else model.unet
    one_pass = _one_flow_pass if config.flow_model else _one_denoiser_pass
    tensors = {id(t) for t in [*model.parameters(), *model.buffers()]}
    input_ids = _prompt_ids(model, rows, config.flow_model)
    recomputed = {"policy_gradient": config.sampling.num_inference_steps, "flow_grpo": config.flow.rollout_steps}
    # A flow model's Euler loop reads its noise levels' values: it runs outside the fake mode, where the fake
    # parameters still make every pass through them fake, while the noise levels stay real.
    with contextlib.nullcontext() if config.flow_model else fake_mode:
        model.checkpointed = config.actor.training_args.gradient_checkpointing
        if config.algorithm in recomputed:  # the update recomputes every step's pass with its gradient
            activations = recomputed[config.algorithm] * saved_bytes(lambda: one_pass(model, input_ids), tensors)
        elif config.algorithm == "diffusion_nft":  # one pass at one noise level per sample
            activations = saved_bytes(lambda: one_pass(model, input_ids), tensors)
        else:
            activations = saved_bytes(lambda: model(input_ids), tensors)
            if model.checkpointed:  # backward recomputes one gradient step's denoiser pass at a time
                activations += saved_bytes(lambda: one_pass(model, input_ids), tensors)
        params = {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()}
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        largest = max(p.numel() for p in model.parameters())
    args = config.actor.model_args
    if args.lora_rank > 0:
        name = "transformer" if config.flow_model else "unet"
        adapters = lora_parameter_count(denoiser, args.lora_rank, list(args.lora_target_modules))
        if not adapters:
            raise ConfigError(
                f"actor.model_args.lora_target_modules={list(args.lora_target_modules)} names no linear or convolution "
                f"layer of the {name}: LoRA would train nothing; name its attention projections, e.g. "
                "[to_q, to_k, to_v, to_out.0]"
            )
        params[f"{name} lora"], trainable = adapters, trainable - params[name] + adapters
    return ActorCensus({name: count for name, count in params.items() if count}, trainable, largest, activations)


def _prompt_ids(model: RewardFLModel | FlowRewardModel, rows: int, flow: bool) -> torch.Tensor:
    """`rows` one-word prompts as the actor's forward takes them."""
    if flow:
        return model.parts.pipeline.tokenizer(["a"] * rows, return_tensors="pt")["input_ids"]
    from roll.models.diffusion.parts import encode_prompts

    return encode_prompts(model.parts.tokenizer, ["a"] * rows)["input_ids"]


def lora_parameter_count(module: torch.nn.Module, rank: int, targets: list[str]) -> int:
    """Parameters of rank-`rank` LoRA adapters on the linear and convolution layers of `module` whose name is one of
    `targets` or ends with `.target` (as peft matches them): A maps the input to `rank`, B `rank` to the output."""
    count = 0
    for name, layer in module.named_modules():
        if not any(name == target or name.endswith(f".{target}") for target in targets):
            continue
        if isinstance(layer, torch.nn.Linear):
            count += rank * (layer.in_features + layer.out_features)
        elif isinstance(layer, torch.nn.Conv2d):
            kernel = layer.kernel_size[0] * layer.kernel_size[1]
            count += rank * (layer.in_channels * kernel + layer.out_channels)
    return count


def _one_denoiser_pass(model: RewardFLModel, input_ids: torch.Tensor) -> torch.Tensor:
    cond, uncond = model.conditioning(input_ids)
    config = model.unet.config
    sample = torch.randn(len(input_ids), config.in_channels, config.sample_size, config.sample_size, dtype=cond.dtype)
    return model.noise_predictor(model.unet, cond, uncond)(sample, torch.tensor(500))


def _one_flow_pass(model: FlowRewardModel, input_ids: torch.Tensor) -> torch.Tensor:
    from roll.pipeline.diffusion.flow_model import encode_flow_prompts

    prompts = model.parts.pipeline.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
    cond = encode_flow_prompts(model.parts, prompts)
    uncond = encode_flow_prompts(model.parts, [""] * len(prompts)) if model.sampling.guidance_scale > 1 else None
    noise = torch.randn(model.latent_shape(len(prompts)), dtype=cond["encoder_hidden_states"].dtype)
    return model.velocity_predictor(model.transformer, cond, uncond)(noise, torch.tensor(500.0))


def actor_breakdown(config: RewardFLConfig, role: WorkerConfig, platform: str) -> RankBreakdown:
    """What one actor rank holds: each part's weights (frozen ones too: ZeRO-3 shards them all), the ZeRO states of
    the trainable ones, then a micro-batch's activations with the reduce buckets (stages 1-2) or the gathered
    parameters (stage 3), and the optimizer step's working set."""
    census = census_actor(config)
    stage, offload_optimizer, offload_params, zero = _zero_block(role)
    dtype, ranks = role.model_args.dtype, role.dp_size
    width, total = DTYPE_BYTES[dtype], sum(census.params.values())
    states = zero_model_states(
        stage,
        total,
        ranks,
        trainable=census.trainable,
        dtype=dtype,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
    )
    place = states[0].place  # where the parameters live (offload_param at stage 3)
    resident = [
        MemoryItem(f"{name} params", width * (_share(count, ranks) if stage == 3 else count), place)
        for name, count in census.params.items()
    ]
    resident += states[1:]
    train = [MemoryItem("activations", census.activations)]
    buckets = reduce_buckets(zero, stage, census.trainable, dtype, platform)
    notes: tuple[str, ...] = (
        "activations counted by running the actor's forward once on fake tensors (roll/pipeline/diffusion/"
        "memory_estimate.py)",
    )
    if stage == 3:
        resident.append(buckets)
        kept = min(int(zero.get(key, _DS_LIVE_PARAMETERS)) for key in _DS_LIVE_KEYS)
        train.append(MemoryItem("gathered params", width * min(total, kept)))
    elif stage in (1, 2):
        train.append(buckets)
    step = optimizer_step_bytes(
        stage,
        census.trainable,
        ranks,
        dtype=dtype,
        offload_optimizer=offload_optimizer,
        fused_optimizer=platform == "cuda",
        largest_param=census.largest_param,
    )
    return tuple(resident), {"train micro-batch": tuple(train), "optimizer step": step}, notes
