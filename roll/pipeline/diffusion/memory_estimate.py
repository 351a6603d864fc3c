"""The dry run's memory estimate of a Reward FL actor rank: every part's weights, the ZeRO states of the parts that
train, and the activations one micro-batch keeps for backward.

A diffusion model's layers are too varied for the closed forms of the decoder estimate (`dry_run.activations`),
so the parts are built from their configs under torch's `FakeTensorMode` (tensors with shapes and dtypes but no
storage, dispatched as on the CPU, so each kernel saves what it saves there: the CPU flash attention its
log-sum-exp, not the attention matrix) and the actor's real forward runs once on them, counting every distinct
tensor autograd saves for backward: the K gradient steps' denoiser passes (both halves of guidance), the
regulariser, the VAE decode, the reward network and a trained text encoder. With gradient checkpointing the
census also counts one denoiser pass, recomputed in backward while the rest is kept. The reward is built for
real (its weights loaded: `from_pretrained` refuses fake tensors); the other parts load no weights.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roll.configs.model_dir import DTYPE_BYTES
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
    from torch._subclasses.fake_tensor import unset_fake_temporarily
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
    set_timesteps = scheduler.set_timesteps

    def real_timesteps(*args: Any, **kwargs: Any) -> None:
        # The loop branches on each timestep's value (which steps keep their gradient, the step's previous alpha):
        # as plain numbers the timesteps stay real under the fake mode.
        with unset_fake_temporarily():
            set_timesteps(*args, **kwargs)
            scheduler.timesteps = scheduler.timesteps.tolist()

    scheduler.set_timesteps = real_timesteps
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
    module): the Reward FL forward, or for `algorithm=policy_gradient` the update's passes, one per denoising step
    (each step's log-probability is recomputed with its gradient; the Gaussians' own few latents are left out)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from roll.models.diffusion.parts import encode_prompts

    rows = config.actor.training_args.per_device_train_batch_size
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with warnings.catch_warnings():  # copying a fake denoiser for the reference reads its (absent) data pointers
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        model = fake_actor_model(config, fake_mode)
    tensors = {id(t) for t in [*model.parameters(), *model.buffers()]}
    input_ids = encode_prompts(model.parts.tokenizer, ["a"] * rows)["input_ids"]
    with fake_mode:
        model.checkpointed = config.actor.training_args.gradient_checkpointing
        if config.algorithm == "policy_gradient":  # the update recomputes every step's pass with its gradient
            one_pass = saved_bytes(lambda: _one_denoiser_pass(model, input_ids), tensors)
            activations = config.sampling.num_inference_steps * one_pass
        else:
            activations = saved_bytes(lambda: model(input_ids), tensors)
            if model.checkpointed:  # backward recomputes one gradient step's denoiser pass at a time
                activations += saved_bytes(lambda: _one_denoiser_pass(model, input_ids), tensors)
        params = {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()}
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        largest = max(p.numel() for p in model.parameters())
    args = config.actor.model_args
    if args.lora_rank > 0:
        adapters = lora_parameter_count(model.unet, args.lora_rank, list(args.lora_target_modules))
        params["unet lora"], trainable = adapters, trainable - params["unet"] + adapters
    return ActorCensus({name: count for name, count in params.items() if count}, trainable, largest, activations)


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
