"""The flow-matching part of the Reward FL config: its settings (`flow:` in YAML) and the checks that tie the
algorithm, the model's kind, the worker and the gradient window together."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from roll.configs.schema import ConfigError, check
from roll.models.diffusion.flow_parts import euler_scheduler, flow_family, is_hub_id, local_scheduler_config
from roll.pipeline.diffusion.flow_sampling import flow_sigmas, kept_steps

if TYPE_CHECKING:
    from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig

# Algorithms that sample a group of images per prompt and normalise their rewards within it.
GROUP_ALGORITHMS = ("policy_gradient", "flow_grpo", "diffusion_nft")
FLOW_ALGORITHMS = ("flow_grpo", "diffusion_nft")
FLOW_WORKER = "roll.pipeline.diffusion.flow_worker.FlowRewardFLWorker"


@dataclass
class FlowArguments:
    """Settings of flow-matching models: the sample's size, and the rollouts of Flow-GRPO and DiffusionNFT."""

    # Pixels per side (0: the transformer's sample size times the VAE's factor) and video frames (Wan: 1 + 4k).
    image_size: int = field(default=0, metadata=check(ge=0, hint="0 takes the model's own size"))
    frames: int = field(default=81, metadata=check(ge=1, hint="video models only"))
    # Euler steps of a training rollout; evaluation uses sampling.num_inference_steps (Flow-GRPO trains on fewer).
    rollout_steps: int = field(default=4, metadata=check(ge=1))
    # Flow-GRPO's SDE noise level a (the diffusion is a x sqrt(sigma / (1 - sigma))); DiffusionNFT may use 0 (ODE).
    noise_level: float = field(default=0.7, metadata=check(ge=0, le=2))
    # DiffusionNFT: how far the implicit positive / negative policies step from the old one, and the advantage
    # that maps to optimality probability 1.
    nft_beta: float = field(default=1.0, metadata=check(gt=0))
    nft_advantage_clip: float = field(default=1.0, metadata=check(gt=0))


def check_flow_config(config: RewardFLConfig) -> None:
    """The algorithm fits the model's kind (flow or UNet), the worker and trainable parts fit the model, the
    rollout settings fit the algorithm, and the gradient window holds exactly `sampling.grad_steps` steps."""
    model = config.warm_start.base_model or config.actor.model_args.model_name_or_path
    family = flow_family(model)
    flow = family is not None or is_hub_id(model)
    if config.algorithm in FLOW_ALGORITHMS and not flow:
        raise ConfigError(
            f"algorithm={config.algorithm} needs a flow-matching model (SD3 / Wan, or tiny-diffusion://sd3 / wan), "
            f"and {model!r} is not one; use algorithm=policy_gradient (DDPO) for a UNet"
        )
    if config.algorithm == "policy_gradient" and flow:
        raise ConfigError(
            f"algorithm=policy_gradient is DDPO on a DDIM UNet, and {model!r} is a flow-matching model: use "
            "algorithm=flow_grpo or algorithm=diffusion_nft"
        )
    if not flow:
        if "transformer" in config.trainable_models:
            raise ConfigError(f"trainable_models lists transformer, and {model!r} is a UNet model: list unet")
        return
    if config.trainable_models != ["transformer"]:
        raise ConfigError(
            f"trainable_models={config.trainable_models} on the flow-matching model {model!r}: only its transformer "
            "trains (its text encoders stay frozen); set trainable_models=[transformer]"
        )
    if config.actor.worker_cls != FLOW_WORKER:
        raise ConfigError(f"actor.worker_cls={config.actor.worker_cls!r} cannot hold a flow model: set {FLOW_WORKER}")
    if config.algorithm == "flow_grpo" and config.flow.noise_level == 0:
        raise ConfigError("flow.noise_level=0 leaves Flow-GRPO's steps without a log-probability: set it above 0")
    if config.algorithm in FLOW_ALGORITHMS and config.flow.rollout_steps > config.sampling.num_inference_steps:
        raise ConfigError(
            f"flow.rollout_steps={config.flow.rollout_steps} is more than sampling.num_inference_steps="
            f"{config.sampling.num_inference_steps}: training rollouts take at most the evaluation's steps"
        )
    if config.algorithm == "reward_fl":
        check_gradient_window(config, model)


def check_gradient_window(config: RewardFLConfig, model: str) -> None:
    """At least `sampling.grad_steps` of the schedule's Euler steps lie in the timestep window, so the reward's
    gradient reaches exactly that many (a hub model's schedule is checked when it loads)."""
    scheduler_config = local_scheduler_config(model)
    if scheduler_config is None:
        return
    scheduler = euler_scheduler(scheduler_config)
    sampling = config.sampling
    sigmas = flow_sigmas(scheduler, sampling.num_inference_steps)
    kept = sum(kept_steps(sigmas, sampling, scheduler.config.num_train_timesteps))
    if kept < sampling.grad_steps:
        timesteps = [round(s * scheduler.config.num_train_timesteps) for s in sigmas[:-1].tolist()]
        raise ConfigError(
            f"sampling.min_timestep={sampling.min_timestep} and sampling.max_timestep={sampling.max_timestep} hold "
            f"{kept} of the {sampling.num_inference_steps} Euler steps (timesteps {timesteps}), fewer than "
            f"sampling.grad_steps={sampling.grad_steps}: the reward's gradient would reach {kept} steps; widen the "
            "window or lower grad_steps"
        )
