"""The module a flow-matching Reward FL worker's engine owns: the pipeline's transformer (trained), its text
encoders and VAE (frozen), an optional frozen reference transformer and the reward.

Like `RewardFLModel` its forward pass takes a batch of prompt ids, so the training strategy's micro-batches,
accumulation and ZeRO sharding apply unchanged; the prompts are decoded back to text and encoded by the
diffusers pipeline's own `encode_prompt` (all of SD3's three encoders, or Wan's T5). A video is scored by the
image reward's video rule (its frames' mean, unless the reward scores videos itself). Noise comes from
torch's generator: the worker seeds it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from roll.configs.worker_config import ModelArguments
from roll.models.diffusion.flow_parts import FlowParts, save_flow_parts
from roll.pipeline.diffusion.flow_config import FlowArguments
from roll.pipeline.diffusion.flow_sampling import (
    VelocityPredictor,
    denoise_flow,
    nft_loss,
    sample_sde_trajectory,
    sde_step_log_probs,
)
from roll.pipeline.diffusion.reward_fl_model import (
    RewardFLOutput,
    RolloutOutput,
    make_trainable,
    merge_lora,
    rollout_output,
    without_adapters,
)
from roll.pipeline.diffusion.sampling import SamplingArguments
from roll.rewards.image_rewards import ImageReward

# diffusers' defaults for the T5 prompt length of SD3 and Wan; a tokenizer with a shorter limit uses its own.
PROMPT_TOKENS = {"image": 256, "video": 226}


@dataclass
class FlowPolicyConditioning:
    """Flow-GRPO's update: the velocity predictor conditioned on the prompts, through which `log_probs`
    recomputes the recorded SDE steps' log-probabilities with gradient."""

    predict: VelocityPredictor
    scheduler: Any
    noise_level: float

    def log_probs(self, latents: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """`[B, T]`: each recorded step's log-probability under the current model (`sde_step_log_probs`)."""
        return sde_step_log_probs(self.predict, self.scheduler, latents, sigmas, self.noise_level)


@dataclass
class FlowNFTConditioning:
    """DiffusionNFT's update: the trained (and, with a regulariser, the frozen) velocity predictors on the prompts."""

    predict: VelocityPredictor
    reference: VelocityPredictor | None
    scheduler: Any
    beta: float

    def losses(self, samples: torch.Tensor, optimality: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: DiffusionNFT's loss at one noise level drawn uniformly for each final sample, and the squared
        distance of the trained from the frozen velocity there (zeros without a reference)."""
        shape = (len(samples),) + (1,) * (samples.dim() - 1)
        sigma = torch.rand(shape, device=samples.device, dtype=samples.dtype)
        noise = torch.randn_like(samples)
        noisy = (1 - sigma) * samples + sigma * noise
        timestep = sigma.flatten() * self.scheduler.config.num_train_timesteps
        velocity = self.predict(noisy, timestep)
        loss = nft_loss(velocity, velocity.detach(), noise - samples, optimality, self.beta)
        if self.reference is None:
            return loss, torch.zeros_like(loss)
        with torch.no_grad():
            frozen = self.reference(noisy, timestep)
        return loss, (velocity - frozen).pow(2).flatten(1).mean(dim=1)


@torch.no_grad()
def encode_flow_prompts(
    parts: FlowParts, prompts: list[str], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The transformer's text conditioning of `prompts` from the pipeline's own `encode_prompt` (the empty prompt
    encoded so is guidance's unconditional input, as in diffusers)."""
    pipeline = parts.pipeline
    tokenizer = getattr(pipeline, "tokenizer_3", None) or pipeline.tokenizer
    length = min(tokenizer.model_max_length, PROMPT_TOKENS[parts.family])
    options = {"do_classifier_free_guidance": False, "max_sequence_length": length, "device": device}
    if parts.family == "image":
        embeds, _, pooled, _ = pipeline.encode_prompt(prompts, prompts, prompts, **options)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}
    return {"encoder_hidden_states": pipeline.encode_prompt(prompts, **options)[0]}


class FlowRewardModel(torch.nn.Module):
    """Transformer, text encoders, VAE, optional frozen reference and reward, as one module.

    `mode` selects what a forward pass does: `reward_fl` (Euler sampling with the gradient through the kept
    steps, then the reward and the regulariser), `rollout` (SDE samples with their trajectories, for Flow-GRPO
    and DiffusionNFT), `policy` (Flow-GRPO's conditioning) or `nft` (DiffusionNFT's).
    """

    def __init__(self, parts: FlowParts, reward: ImageReward, model_args: ModelArguments, with_reference: bool) -> None:
        super().__init__()
        self.parts = parts
        self.transformer, self.vae, self.reward = parts.transformer, parts.vae, reward
        self.text_encoders = torch.nn.ModuleList(parts.text_encoders)
        for module in (self.transformer, self.vae, self.text_encoders):
            module.requires_grad_(False)
        self.reference_transformer = None
        if with_reference and model_args.lora_rank == 0:
            self.reference_transformer = copy.deepcopy(self.transformer).eval()
        self.lora_scaling = make_trainable(self.transformer, model_args)
        self.with_reference = with_reference
        self.sampling = SamplingArguments()
        self.flow = FlowArguments()
        self.mode = "reward_fl"
        self.checkpointed = False
        self.config = SimpleNamespace(use_cache=False)  # what the training strategy reads on a Hugging Face model

    def train(self, mode: bool = True) -> FlowRewardModel:
        """Train mode for the transformer only: the frozen parts stay in eval mode, since T5's dropout (0.1 in SD3's
        and Wan's encoders) would condition a policy update differently from the rollout it recomputes."""
        super().train(mode)
        for module in (self.text_encoders, self.vae, self.reward, self.reference_transformer):
            if module is not None:
                module.eval()
        return self

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Recompute each kept step's transformer pass in backward (training_args.gradient_checkpointing)."""
        self.checkpointed = True

    def velocity_predictor(
        self, transformer: torch.nn.Module, cond: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor] | None
    ) -> VelocityPredictor:
        """(sample, timestep) -> `transformer`'s velocity, guided by `guidance_scale` when `uncond` is given."""
        scale = self.sampling.guidance_scale

        def predict(sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
            timesteps = timestep.to(sample.dtype).expand(len(sample)) if timestep.dim() == 0 else timestep
            if uncond is None:
                return transformer(hidden_states=sample, timestep=timesteps, **cond, return_dict=False)[0]
            both = {key: torch.cat([uncond[key], cond[key]]) for key in cond}
            doubled = torch.cat([sample, sample])
            output = transformer(hidden_states=doubled, timestep=timesteps.repeat(2), **both, return_dict=False)[0]
            unconditional, conditional = output.chunk(2)
            return unconditional + scale * (conditional - unconditional)

        return predict

    def latent_shape(self, rows: int) -> tuple[int, ...]:
        """The shape of `rows` initial noises: `[B, C, h, w]` for images, `[B, C, f, h, w]` for video."""
        vae, channels = self.vae.config, self.transformer.config.in_channels
        if self.parts.family == "image":
            factor = 2 ** (len(vae.block_out_channels) - 1)
            size = self.flow.image_size // factor if self.flow.image_size else self.transformer.config.sample_size
            return (rows, channels, size, size)
        if not self.flow.image_size:
            raise ValueError("flow.image_size=0: a video model has no size of its own; set flow.image_size")
        size = self.flow.image_size // vae.scale_factor_spatial
        frames = (self.flow.frames - 1) // vae.scale_factor_temporal + 1
        return (rows, channels, frames, size, size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
    ) -> RewardFLOutput | RolloutOutput | FlowPolicyConditioning | FlowNFTConditioning:
        """Sample one image (or video) per prompt of `input_ids` and score it (the other modes: see the class)."""
        prompts = self.parts.pipeline.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        device = next(self.transformer.parameters()).device
        cond = encode_flow_prompts(self.parts, prompts, device)
        uncond = None
        if self.sampling.guidance_scale > 1:
            uncond = encode_flow_prompts(self.parts, [""] * len(prompts), device)
        predict = self.velocity_predictor(self.transformer, cond, uncond)
        if self.mode == "policy":
            return FlowPolicyConditioning(predict, self.parts.scheduler, self.flow.noise_level)
        if self.mode == "nft":
            reference = self._reference_predictor(cond, uncond) if self.with_reference else None
            return FlowNFTConditioning(predict, reference, self.parts.scheduler, self.flow.nft_beta)
        dtype = cond["encoder_hidden_states"].dtype
        noise = torch.randn(self.latent_shape(len(prompts)), device=input_ids.device, dtype=dtype)
        if self.mode == "rollout":
            return self._rollout(predict, noise, prompts)
        distances: list[torch.Tensor] = []
        reference = self._reference_predictor(cond, uncond) if self.with_reference else None

        def regularise(sample: torch.Tensor, timestep: torch.Tensor, velocity: torch.Tensor) -> None:
            with torch.no_grad():
                frozen = reference(sample, timestep)
            distances.append((velocity - frozen).pow(2).flatten(1).mean(dim=1))

        sample = denoise_flow(
            predict, self.parts.scheduler, noise, self.sampling, self.checkpointed, regularise if reference else None
        )
        images = self.decode(sample)
        regulariser = torch.stack(distances).mean(dim=0) if distances else torch.zeros(len(images), device=noise.device)
        return RewardFLOutput(images, self.reward(images, prompts), regulariser)

    def _rollout(self, predict: VelocityPredictor, noise: torch.Tensor, prompts: list[str]) -> RolloutOutput:
        trajectory = sample_sde_trajectory(
            predict, self.parts.scheduler, noise, self.flow.rollout_steps, self.flow.noise_level
        )
        images = self.decode(trajectory.latents[:, -1])
        return rollout_output(images, self.reward(images, prompts), trajectory)

    def _reference_predictor(
        self, cond: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor] | None
    ) -> VelocityPredictor:
        if self.reference_transformer is not None:
            return self.velocity_predictor(self.reference_transformer, cond, uncond)
        return without_adapters(self.transformer, self.velocity_predictor(self.transformer, cond, uncond))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images `[B, 3, H, W]` or videos `[B, F, 3, H, W]` (the rewards' layout) in [0, 1] from final latents (the
        VAE's own scaling)."""
        config = self.vae.config
        if self.parts.family == "image":
            pixels = self.vae.decode(latents / config.scaling_factor + config.shift_factor).sample
        else:
            view = (1, -1, 1, 1, 1)
            mean = torch.tensor(config.latents_mean, device=latents.device, dtype=latents.dtype).view(view)
            std = torch.tensor(config.latents_std, device=latents.device, dtype=latents.dtype).view(view)
            pixels = self.vae.decode(latents * std + mean).sample.transpose(1, 2)
        return (pixels / 2 + 0.5).clamp(0, 1)

    def save_pretrained(self, output_dir: str, state_dict: dict[str, torch.Tensor], **_: Any) -> None:
        """Write the trained pipeline as a diffusers directory from full weights by parameter name (LoRA merged). The
        frozen parts are written from them too: under ZeRO-3 their own parameters are empty partitions."""
        encoders = self.parts.named_text_encoders.items()  # self.text_encoders holds them in this order
        modules = {"transformer": ("transformer.", self.transformer), "vae": ("vae.", self.vae)} | {
            name: (f"text_encoders.{index}.", encoder) for index, (name, encoder) in enumerate(encoders)
        }
        states = {}
        for part, (prefix, module) in modules.items():
            weights = {name[len(prefix) :]: t for name, t in state_dict.items() if name.startswith(prefix)}
            persistent = module.state_dict().keys()
            buffers = {name: buffer for name, buffer in module.named_buffers() if name in persistent}
            states[part] = buffers | weights
        states["transformer"] = merge_lora(states["transformer"], self.lora_scaling)
        save_flow_parts(self.parts, output_dir, states)
