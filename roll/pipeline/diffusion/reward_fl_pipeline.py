"""The Reward FL driver: warm start (once), then steps of sampling, scoring and back-propagating the reward.

Before Ray starts, the driver trains the demonstration's warm start unless its directory already holds it
(`warm_start`). Each step the actor samples one image per prompt of a batch of training prompts, scores it
with the reward, and takes one optimizer step on -reward + regulariser (`diffusion_worker`). With
`algorithm=policy_gradient` a step is instead a rollout of `policy.group_size` stochastic samples per prompt,
group-relative advantages of their rewards, and one PPO-clipped update (`policy_gradient`). Evaluation
samples the held-out prompts from the same noise every time, so before and after differ only by the
training: it reports their mean reward and how far the images moved from the first evaluation's (mean
absolute pixel difference, in [0, 1]), and writes both image grids as PNG in the run's log directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from roll.algorithms.reward_shaping import normalize_scores
from roll.datasets.prompt_dataset import PromptSampler
from roll.distributed.scheduler.protocol import DataProto
from roll.models.diffusion.parts import encode_prompts
from roll.models.diffusion.tiny_diffusion import resolve_diffusion_path
from roll.pipeline.base.residency import Residency, phase
from roll.pipeline.base.training_loop import TrainingRunPipeline, before_after_summary
from roll.pipeline.diffusion.diffusion_worker import RewardFLSettings
from roll.pipeline.diffusion.flow_sampling import nft_optimality
from roll.pipeline.diffusion.flow_warm_start import warm_start_of
from roll.pipeline.diffusion.prompts import load_prompts, prompt_splits
from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig
from roll.pipeline.diffusion.video_media import save_samples

REWARD_FL = phase("reward_fl", "actor")
ROLLOUT = phase("rollout", "actor")
POLICY_UPDATE = phase("policy_update", "actor")
# The evaluation's noise seed: the same images before and after for an unchanged model.
EVAL_SEED = 12345
FIRST_IMAGES = "eval_images_first.pt"


class RewardFLPipeline(TrainingRunPipeline):
    """Trains `actor`'s diffusion model on a differentiable image reward through its last denoising steps."""

    config: RewardFLConfig
    trained_role = "actor"
    progress_label = "reward_fl"
    training_phase = REWARD_FL

    def __init__(self, config: RewardFLConfig) -> None:
        started = time.perf_counter()
        self.warm_start = warm_start_of(config)
        super().__init__(config)
        model_path = resolve_diffusion_path(config.actor.model_args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer")
        train, held_out = prompt_splits(load_prompts(config.data.prompt_file), config.data.held_out_prompts)
        self.encode = lambda prompts: DataProto.from_dict(tensors=encode_prompts(tokenizer, prompts))
        self.sampler = PromptSampler(train, config.batch_size, config.seed)
        self.columns = config.data.eval_images_per_prompt
        self.eval_prompts = [prompt for prompt in held_out for _ in range(self.columns)]
        self.settings = RewardFLSettings(
            config.reward.name,
            config.reward.kwargs,
            config.trainable_models,
            config.sampling,
            config.regulariser_weight,
            config.seed,
            config.policy,
            config.flow,
        )
        with self.released_on_failure():
            self.start_cluster("actor").initialize(self.settings)
        self.residency = Residency.of_roles(self.clusters, config.roles())
        self.log_dir = Path(config.run_dir) / "logs"
        self.started = started

    def evaluate(self) -> dict[str, float]:
        """Held-out mean reward, and the mean absolute pixel distance from the first evaluation's images."""
        self.residency.enter(REWARD_FL)
        batch = self.encode(self.eval_prompts)
        padded, pad = batch.pad_to_divisor(self.clusters["actor"].world_size)
        sampled = self.clusters["actor"].sample_images(padded, EVAL_SEED).unpad(pad)
        images = sampled.batch["images"]
        first_path = Path(self.config.run_dir) / FIRST_IMAGES
        if not first_path.exists():
            first_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(images, first_path)
            save_samples(images, self.columns, self.log_dir, "images_before")
        self.latest_images = images
        distance = (images - torch.load(first_path)).abs().mean().item()
        return {"val/reward": sampled.batch["rewards"].mean().item(), "val/distance_from_start": distance}

    def step(self) -> dict[str, float]:
        """One step on the next batch of training prompts: Reward FL, or a rollout and a policy-gradient update."""
        timings: dict[str, float] = {}
        if self.config.algorithm in ("policy_gradient", "flow_grpo"):
            metrics = self.policy_gradient_step(timings)
        elif self.config.algorithm == "diffusion_nft":
            metrics = self.diffusion_nft_step(timings)
        else:
            batch = self.encode(self.sampler.next_batch())
            with self.residency.timed(REWARD_FL, timings):
                metrics = self.clusters["actor"].reward_fl_step(batch)[0]
        # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
        return {f"actor/{key}": value for key, value in metrics.items()} | timings

    def group_rollouts(
        self, timings: dict[str, float]
    ) -> tuple[DataProto, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """`policy.group_size` stochastic samples per prompt of the next batch: the encoded prompts, the actor's
        rollouts, their rewards and the rewards normalised within each prompt's group (GRPO's advantage)."""
        group = self.config.policy.group_size
        prompts = self.sampler.next_batch()
        batch = self.encode([prompt for prompt in prompts for _ in range(group)])
        with self.residency.timed(ROLLOUT, timings):
            rollouts = self.clusters["actor"].sample_rollouts(batch, self.config.seed).batch
        rewards = rollouts["rewards"].float()
        advantages = normalize_scores(rewards, torch.arange(len(prompts)).repeat_interleave(group), "group")
        return batch, rollouts, rewards, advantages

    def policy_gradient_step(self, timings: dict[str, float]) -> dict[str, float]:
        """`policy.group_size` stochastic samples per prompt, their rewards normalised within each prompt's group
        (GRPO's advantage), then one PPO-clipped update on them; the update's metrics and the samples' reward."""
        actor = self.clusters["actor"]
        batch, rollouts, rewards, advantages = self.group_rollouts(timings)
        trajectories = {key: rollouts[key] for key in ("latents", "step_mask", "timesteps")}
        update = batch.union(
            DataProto.from_dict(
                tensors=trajectories | {"old_log_probs": rollouts["log_probs"], "advantages": advantages}
            )
        )
        with self.residency.timed(POLICY_UPDATE, timings):
            metrics = actor.policy_gradient_step(update)[0]
        return metrics | {"reward": rewards.mean().item()}

    def diffusion_nft_step(self, timings: dict[str, float]) -> dict[str, float]:
        """DiffusionNFT: `policy.group_size` samples per prompt from any sampler (`flow.rollout_steps` SDE steps at
        `flow.noise_level`, 0 = Euler), their group-relative advantages mapped to optimality probabilities, then
        one update on the final samples alone; the update's metrics and the samples' reward."""
        actor = self.clusters["actor"]
        batch, rollouts, rewards, advantages = self.group_rollouts(timings)
        optimality = nft_optimality(advantages, self.config.flow.nft_advantage_clip)
        samples = rollouts["latents"][:, -1]
        update = batch.union(DataProto.from_dict(tensors={"samples": samples, "optimality": optimality}))
        with self.residency.timed(POLICY_UPDATE, timings):
            metrics = actor.nft_step(update)[0]
        return metrics | {"reward": rewards.mean().item()}

    def postfix(self, metrics: dict[str, float], evaluation: dict[str, float]) -> dict[str, str]:
        """Loss, the batch's reward and the latest held-out reward."""
        return {
            "loss": f"{metrics['actor/loss']:.3f}",
            "reward": f"{metrics['actor/reward']:.3f}",
            "val_reward": f"{evaluation['val/reward']:.3f}",
        }

    def summarize(self, before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], str]:
        """Held-out reward before and after, the images' distance from the start, the times; the last grid as PNG."""
        grid = save_samples(self.latest_images, self.columns, self.log_dir, "images_after")
        summary = before_after_summary(before, after, "reward", "distance_from_start") | self.warm_start
        summary["wall_s"] = time.perf_counter() - self.started
        line = (
            f"held-out {self.config.reward.name}: {summary['val_reward_before']:.4f} -> "
            f"{summary['val_reward_after']:.4f}; images moved {summary['val_distance_from_start_after']:.4f} "
            f"(mean absolute pixel difference); {summary['wall_s']:.0f} s in all; grids: {grid.parent}/images_*.png"
        )
        return summary, line
