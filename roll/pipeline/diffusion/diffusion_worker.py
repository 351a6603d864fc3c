"""The Reward FL role: a training strategy over `RewardFLModel`, one optimizer step per batch of prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from roll.algorithms.policy_losses import policy_loss
from roll.distributed.executor.strategy_worker import StrategyWorker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.registry import strategy_class
from roll.models.diffusion.parts import load_diffusion_parts
from roll.models.model_providers import dtype_from_name
from roll.pipeline.diffusion.flow_config import FlowArguments
from roll.pipeline.diffusion.policy_gradient import PolicyGradientArguments
from roll.pipeline.diffusion.reward_fl_model import PolicyConditioning, RewardFLModel, RewardFLOutput, RolloutOutput
from roll.pipeline.diffusion.sampling import SamplingArguments
from roll.rewards.image_rewards import build_image_reward


@dataclass
class RewardFLSettings:
    """What the driver tells the actor beyond its role config: the reward, the parts that train, the sampling,
    the loss's regulariser weight, the run's seed, the policy-gradient settings and the flow models' settings."""

    reward_name: str
    reward_kwargs: dict[str, Any]
    trainable_models: list[str]
    sampling: SamplingArguments
    regulariser_weight: float
    seed: int
    policy: PolicyGradientArguments = field(default_factory=PolicyGradientArguments)
    flow: FlowArguments = field(default_factory=FlowArguments)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The noise seed of optimizer step `step` on data-parallel rank `rank`: the same after a resume, whatever the
    ZeRO stage."""
    return (seed * 1_000_003 + step) * 1_009 + rank


class RewardFLWorker(StrategyWorker):
    """Holds the diffusion model, its frozen reference and the reward in one training strategy (`deepspeed_train`)."""

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self, settings: RewardFLSettings) -> None:
        """Build the model's parts, the reward and the training engine around them."""
        config = self.worker_config
        self.settings = settings
        backend = strategy_class(config.strategy_args.strategy_name)
        self.strategy = backend(self)

        def build() -> RewardFLModel:
            parts = load_diffusion_parts(config.model_args.model_name_or_path, dtype_from_name(config.model_args.dtype))
            self.tokenizer = parts.tokenizer
            reward = build_image_reward(settings.reward_name, settings.reward_kwargs)
            model = RewardFLModel(
                parts, reward, settings.trainable_models, config.model_args, settings.regulariser_weight > 0
            )
            model.sampling, model.policy = settings.sampling, settings.policy
            return model

        self.strategy.initialize(build)

    @property
    def model(self) -> RewardFLModel:
        """The module inside the engine."""
        return self.strategy.unwrapped_model

    @register(Dispatch.DP_COMPUTE)
    def reward_fl_step(self, batch: DataProto) -> dict[str, float]:
        """One Reward FL optimizer step on this rank's prompts: loss = -reward + regulariser_weight x regulariser,
        averaged over the images; metrics `loss`, `reward`, `regulariser`."""
        weight = self.settings.regulariser_weight
        torch.manual_seed(step_seed(self.settings.seed, self.strategy.global_step, self.rank_info.dp_rank))

        def loss_func(micro_batch: DataProto, output: RewardFLOutput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = (-output.rewards + weight * output.regulariser).mean()
            return loss, {"reward": output.rewards.detach(), "regulariser": output.regulariser.detach()}

        return self.strategy.train_step(batch, loss_func)

    @register(Dispatch.DP_COMPUTE)
    def sample_images(self, batch: DataProto, seed: int) -> DataProto:
        """One image per prompt with its reward, without gradient, from noise seeded by `seed` (the same images for
        the same model): `images` `[B, 3, H, W]` in [0, 1] and `rewards` `[B]`."""
        torch.manual_seed(step_seed(seed, 0, self.rank_info.dp_rank))

        def forward(micro_batch: DataProto, output: RewardFLOutput) -> tuple[None, dict[str, torch.Tensor]]:
            return None, {"images": output.images, "rewards": output.rewards}

        return DataProto.from_dict(tensors=self.strategy.forward_step(batch, forward))

    @register(Dispatch.DP_COMPUTE)
    def sample_rollouts(self, batch: DataProto, seed: int) -> DataProto:
        """Stochastic samples of the prompts with their trajectories and rewards (`RolloutOutput`'s fields), without
        gradient, for the policy-gradient update; the noise is seeded from `seed` and the optimizer step."""
        torch.manual_seed(step_seed(seed, self.strategy.global_step, self.rank_info.dp_rank))

        def forward(micro_batch: DataProto, output: RolloutOutput) -> tuple[None, dict[str, torch.Tensor]]:
            return None, dict(vars(output))

        self.model.mode = "rollout"
        try:
            return DataProto.from_dict(tensors=self.strategy.forward_step(batch, forward))
        finally:
            self.model.mode = "reward_fl"

    @register(Dispatch.DP_COMPUTE)
    def policy_gradient_step(self, batch: DataProto) -> dict[str, float]:
        """One PPO-clipped update on rollouts (`latents`, `old_log_probs`, `step_mask`, `timesteps`, `advantages`
        per row): each denoising step is one "token" whose log-probability is recomputed under the current model."""
        clip = self.settings.policy.clip_range

        def loss_func(
            micro_batch: DataProto, output: PolicyConditioning
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            log_probs = output.log_probs(data["latents"], data["timesteps"][0])
            advantages = data["advantages"].unsqueeze(-1).expand_as(log_probs)
            return policy_loss(
                log_probs, data["old_log_probs"], advantages, data["step_mask"], clip_low=clip, clip_high=clip
            )

        self.model.mode = "policy"
        try:
            return self.strategy.train_step(batch, loss_func)
        finally:
            self.model.mode = "reward_fl"

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, output_dir: str) -> str:
        """Write the trained model as a diffusers directory (its tokenizer and scheduler included)."""
        return self.strategy.export_hf(output_dir)
