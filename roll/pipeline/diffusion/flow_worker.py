"""The Reward FL role for flow-matching models: `RewardFLWorker` holding a `FlowRewardModel`, plus DiffusionNFT's
update. Reward FL, evaluation, Flow-GRPO's rollouts and its clipped update are the parent's methods, since the
flow model answers them in the same shapes."""

from __future__ import annotations

import torch

from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.registry import strategy_class
from roll.models.diffusion.flow_parts import load_flow_parts
from roll.models.model_providers import dtype_from_name
from roll.pipeline.diffusion.diffusion_worker import RewardFLSettings, RewardFLWorker, step_seed
from roll.pipeline.diffusion.flow_model import FlowNFTConditioning, FlowRewardModel
from roll.rewards.image_rewards import build_image_reward


class FlowRewardFLWorker(RewardFLWorker):
    """Holds a flow-matching pipeline's transformer, its frozen parts and the reward in one training strategy."""

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self, settings: RewardFLSettings) -> None:
        """Load the pipeline, build the reward and the training engine around them."""
        config = self.worker_config
        self.settings = settings
        self.strategy = strategy_class(config.strategy_args.strategy_name)(self)

        def build() -> FlowRewardModel:
            parts = load_flow_parts(config.model_args.model_name_or_path, dtype_from_name(config.model_args.dtype))
            self.tokenizer = parts.pipeline.tokenizer
            reward = build_image_reward(settings.reward_name, settings.reward_kwargs)
            model = FlowRewardModel(parts, reward, config.model_args, settings.regulariser_weight > 0)
            model.sampling, model.policy, model.flow = settings.sampling, settings.policy, settings.flow
            return model

        self.strategy.initialize(build)

    @register(Dispatch.DP_COMPUTE)
    def nft_step(self, batch: DataProto) -> dict[str, float]:
        """One DiffusionNFT optimizer step on final samples (`samples`) and their optimality (`optimality` in
        [0, 1]) per row: loss = NFT loss + regulariser_weight x distance to the frozen velocity."""
        weight = self.settings.regulariser_weight
        torch.manual_seed(step_seed(self.settings.seed, self.strategy.global_step, self.rank_info.dp_rank) + 1)

        def loss_func(
            micro_batch: DataProto, output: FlowNFTConditioning
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            nft, regulariser = output.losses(data["samples"], data["optimality"].to(data["samples"].dtype))
            loss = (nft + weight * regulariser).mean()
            return loss, {"nft_loss": nft.detach(), "regulariser": regulariser.detach()}

        self.model.mode = "nft"
        try:
            return self.strategy.train_step(batch, loss_func)
        finally:
            self.model.mode = "reward_fl"
