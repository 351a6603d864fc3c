"""The module a Reward FL worker's engine owns: a diffusion model's parts, a frozen reference and the reward.

Its forward pass takes a batch of prompt ids (as a language model's would, so the training strategy's
micro-batches, accumulation and ZeRO sharding apply unchanged), samples one image per prompt with the
truncated-gradient loop of `sampling.denoise`, decodes it (through the VAE, if the model has one) and scores
it. The gradient of the reward then reaches the trainable parts through the last K denoising steps only.
Noise comes from torch's generator: the worker seeds it before each call.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from roll.configs.worker_config import ModelArguments
from roll.models.diffusion.parts import DiffusionParts, encode_prompts, save_diffusion_parts
from roll.pipeline.diffusion.policy_gradient import (
    PolicyGradientArguments,
    Trajectory,
    sample_trajectory,
    step_log_probs,
)
from roll.pipeline.diffusion.sampling import NoisePredictor, SamplingArguments, denoise
from roll.rewards.image_rewards import ImageReward

LORA_KEY = re.compile(r"(.*)\.lora_([AB])\.default\.weight")


@dataclass
class RewardFLOutput:
    """One sampled image per prompt `[B, 3, H, W]` in [0, 1], its reward `[B]`, and the mean squared distance of
    the trained from the frozen noise prediction over the gradient steps `[B]` (zeros without a reference)."""

    images: torch.Tensor
    rewards: torch.Tensor
    regulariser: torch.Tensor


@dataclass
class RolloutOutput:
    """Stochastic samples for the policy-gradient variant, row by row: `images`, `rewards`, the trajectory's
    `latents` `[B, T + 1, ...]` and `log_probs` `[B, T]`, and per row the `step_mask` and `timesteps` `[B, T]`."""

    images: torch.Tensor
    rewards: torch.Tensor
    latents: torch.Tensor
    log_probs: torch.Tensor
    step_mask: torch.Tensor
    timesteps: torch.Tensor


@dataclass
class PolicyConditioning:
    """What the policy update's loss needs from a forward pass: the noise predictor conditioned on the prompts,
    through which `log_probs` recomputes the recorded steps' log-probabilities with gradient."""

    predict: NoisePredictor
    scheduler: Any
    eta: float

    def log_probs(self, latents: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """`[B, T]`: each recorded step's log-probability under the current model (`policy_gradient.step_log_probs`)."""
        return step_log_probs(self.predict, self.scheduler, latents, timesteps, self.eta)


class RewardFLModel(torch.nn.Module):
    """Text encoder, denoiser, optional VAE, optional frozen reference denoiser and the reward model, as one module.

    `trainable` names the parts that train (`unet`, `text_encoder`); with `model_args.lora_rank` > 0 the UNet
    trains LoRA adapters on `model_args.lora_target_modules` only, and its reference is the same UNet with the
    adapters disabled. Without LoRA a frozen copy of the initial UNet is kept when `with_reference`.

    `mode` selects what a forward pass does: `reward_fl` (above), `rollout` (stochastic samples with their
    trajectories, for the policy-gradient variant) or `policy` (the conditioning its update needs).
    """

    def __init__(
        self,
        parts: DiffusionParts,
        reward: ImageReward,
        trainable: list[str],
        model_args: ModelArguments,
        with_reference: bool,
    ) -> None:
        super().__init__()
        self.parts = parts  # the scheduler, tokenizer and source directory; the modules are registered below
        self.unet, self.text_encoder, self.vae, self.reward = parts.unet, parts.text_encoder, parts.vae, reward
        self.lora_scaling = 0.0
        for module in (self.unet, self.text_encoder, self.vae):
            if module is not None:
                module.requires_grad_(False)
        self.reference_unet = None
        if with_reference and model_args.lora_rank == 0:
            self.reference_unet = copy.deepcopy(self.unet).eval()
        # The reference conditions on the frozen text encoder's states: from the trained one's, the regulariser
        # would not anchor the text encoder at all.
        self.reference_text_encoder = None
        if with_reference and "text_encoder" in trainable:
            self.reference_text_encoder = copy.deepcopy(self.text_encoder).eval()
        # The unconditional input of guidance: the empty prompt as the tokenizer encodes it (with its special
        # tokens), which is what the dropped prompts of the warm start, and of Stable Diffusion's training, were.
        self.empty_prompt_ids = encode_prompts(parts.tokenizer, [""])["input_ids"]
        if "text_encoder" in trainable:
            self.text_encoder.requires_grad_(True)
        if "unet" in trainable:
            self.lora_scaling = make_trainable(self.unet, model_args)
        self.with_reference = with_reference
        self.sampling = SamplingArguments()
        self.policy = PolicyGradientArguments()
        self.mode = "reward_fl"
        self.checkpointed = False
        # What the training strategy reads and writes on a Hugging Face model.
        self.config = SimpleNamespace(use_cache=False)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Recompute each gradient step's noise prediction in backward (training_args.gradient_checkpointing)."""
        self.checkpointed = True

    def encode(self, input_ids: torch.Tensor, text_encoder: torch.nn.Module | None = None) -> torch.Tensor:
        """The hidden states `[B, T, D]` of `text_encoder` (default: the trained one) (no attention mask: padding is
        attended, as Stable Diffusion conditions); without gradient unless that encoder trains."""
        text_encoder = text_encoder or self.text_encoder
        trains = any(p.requires_grad for p in text_encoder.parameters())
        with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
            return text_encoder(input_ids=input_ids).last_hidden_state

    def conditioning(
        self, input_ids: torch.Tensor, text_encoder: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the prompts' states, the empty prompt's states without gradient, or None without guidance) from
        `text_encoder` (default: the trained one)."""
        cond = self.encode(input_ids, text_encoder)
        if self.sampling.guidance_scale <= 1:
            return cond, None
        empty = self.empty_prompt_ids.to(input_ids.device).expand(len(input_ids), -1)
        return cond, self.encode(empty, text_encoder).detach()

    def noise_predictor(self, unet: torch.nn.Module, cond: torch.Tensor, uncond: torch.Tensor | None) -> NoisePredictor:
        """(sample, timestep) -> `unet`'s noise prediction, guided by `guidance_scale` when `uncond` is given."""
        scale = self.sampling.guidance_scale

        def predict(sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
            if uncond is None:
                return unet(sample, timestep, encoder_hidden_states=cond).sample
            both = unet(torch.cat([sample, sample]), timestep, encoder_hidden_states=torch.cat([uncond, cond])).sample
            unconditional, conditional = both.chunk(2)
            return unconditional + scale * (conditional - unconditional)

        return predict

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
    ) -> RewardFLOutput | RolloutOutput | PolicyConditioning:
        """Sample one image per prompt of `input_ids`, score it, and measure its distance from the reference (the
        other modes: see the class)."""
        cond, uncond = self.conditioning(input_ids)
        if self.mode == "policy":
            return PolicyConditioning(
                self.noise_predictor(self.unet, cond, uncond), self.parts.scheduler, self.policy.eta
            )
        config = self.unet.config
        shape = (len(input_ids), config.in_channels, config.sample_size, config.sample_size)
        noise = torch.randn(shape, device=cond.device, dtype=cond.dtype)  # the model's dtype (bf16 on GPUs)
        prompts = self.parts.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        if self.mode == "rollout":
            return self._rollout(noise, cond, uncond, prompts)
        distances: list[torch.Tensor] = []
        reference = self._reference_predictor(input_ids, cond, uncond) if self.with_reference else None

        def regularise(sample: torch.Tensor, timestep: torch.Tensor, predicted: torch.Tensor) -> None:
            with torch.no_grad():
                frozen = reference(sample, timestep)
            distances.append((predicted - frozen).pow(2).mean(dim=(1, 2, 3)))

        predict = self.noise_predictor(self.unet, cond, uncond)
        sample = denoise(
            predict, self.parts.scheduler, noise, self.sampling, self.checkpointed, regularise if reference else None
        )
        images = self.decode(sample)
        regulariser = torch.stack(distances).mean(dim=0) if distances else torch.zeros(len(images), device=cond.device)
        return RewardFLOutput(images, self.reward(images, prompts), regulariser)

    def _rollout(
        self, noise: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None, prompts: list[str]
    ) -> RolloutOutput:
        predict = self.noise_predictor(self.unet, cond, uncond)
        steps = self.sampling.num_inference_steps
        trajectory = sample_trajectory(predict, self.parts.scheduler, noise, steps, self.policy.eta)
        images = self.decode(trajectory.latents[:, -1])
        return rollout_output(images, self.reward(images, prompts), trajectory)

    def _reference_predictor(
        self, input_ids: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None
    ) -> NoisePredictor:
        """The frozen model's noise predictor, conditioned by the frozen text encoder when the trained one moves."""
        cond = cond.detach()
        if self.reference_text_encoder is not None:
            with torch.no_grad():
                cond, uncond = self.conditioning(input_ids, self.reference_text_encoder)
        if self.reference_unet is not None:
            return self.noise_predictor(self.reference_unet, cond, uncond)
        return without_adapters(self.unet, self.noise_predictor(self.unet, cond, uncond))

    def decode(self, sample: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] from the final sample (pixels in [-1, 1], or VAE latents)."""
        if self.vae is not None:
            sample = self.vae.decode(sample / self.vae.config.scaling_factor).sample
        return (sample / 2 + 0.5).clamp(0, 1)

    def save_pretrained(self, output_dir: str, state_dict: dict[str, torch.Tensor], **_: Any) -> None:
        """Write the trained model as a diffusers directory from full weights by parameter name (LoRA merged)."""
        by_part: dict[str, dict[str, torch.Tensor]] = {"unet": {}, "text_encoder": {}}
        for name, tensor in state_dict.items():
            part, _, key = name.partition(".")
            if part in by_part:
                by_part[part][key] = tensor
        for part in by_part:
            buffers = {name: buffer for name, buffer in getattr(self, part).named_buffers()}
            by_part[part] = buffers | by_part[part]
        by_part["unet"] = merge_lora(by_part["unet"], self.lora_scaling)
        save_diffusion_parts(self.parts, output_dir, by_part)


def make_trainable(module: torch.nn.Module, model_args: ModelArguments) -> float:
    """Train a diffusers model (UNet or transformer): with `model_args.lora_rank` > 0 only LoRA adapters added on
    `model_args.lora_target_modules`, returning their scaling (alpha / rank); else all its weights, returning 0."""
    if model_args.lora_rank == 0:
        module.requires_grad_(True)
        return 0.0
    from peft import LoraConfig

    module.add_adapter(
        LoraConfig(
            r=model_args.lora_rank,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=list(model_args.lora_target_modules),
        )
    )
    for name, param in module.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model_args.lora_alpha / model_args.lora_rank


def without_adapters(module: torch.nn.Module, predict: NoisePredictor) -> NoisePredictor:
    """`predict` (of noise, or of a flow's velocity) run with `module`'s LoRA adapters disabled: the frozen base
    model, without a copy of it."""

    def frozen(sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        module.disable_adapters()
        try:
            return predict(sample, timestep)
        finally:
            module.enable_adapters()

    return frozen


def rollout_output(images: torch.Tensor, rewards: torch.Tensor, trajectory: Trajectory) -> RolloutOutput:
    """A rollout's row-by-row output: the trajectory's per-step mask and timesteps repeated for each row."""
    rows = len(images)
    return RolloutOutput(
        images,
        rewards,
        trajectory.latents,
        trajectory.log_probs,
        trajectory.step_mask.expand(rows, -1).to(images.device),
        trajectory.timesteps.expand(rows, -1).to(images.device),
    )


def merge_lora(weights: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Plain layer weights from a LoRA-adapted state: `W + scaling * B @ A` for each adapted layer, names unwrapped.

    Weights without adapters are returned unchanged.
    """
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if LORA_KEY.fullmatch(name):
            continue
        layer, dot, kind = name.rpartition(".base_layer.")
        if not dot:
            merged[name] = tensor
            continue
        if kind == "weight":
            down, up = weights[f"{layer}.lora_A.default.weight"], weights[f"{layer}.lora_B.default.weight"]
            tensor = tensor + scaling * (up.float() @ down.float()).to(tensor.dtype)
        merged[f"{layer}.{kind}"] = tensor
    return merged
