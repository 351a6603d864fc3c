"""Config of the Reward FL pipeline: the trained diffusion model, its sampling, the reward and the warm start."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from roll.configs.output_dirs import check_writable
from roll.configs.schema import ConfigError, Rule, any_value, check, checked_in_validate
from roll.configs.worker_config import WorkerConfig
from roll.models.diffusion.flow_parts import flow_family, is_hub_id
from roll.models.diffusion.parts import TRAINABLE_PARTS, check_diffusion_dir, load_diffusion_scheduler
from roll.models.diffusion.tiny_diffusion import TINY_DIFFUSION_SCHEME, parse_tiny_diffusion
from roll.pipeline.base.dry_run.backend_ranks import RankBreakdown
from roll.pipeline.base.pipeline_config import EXP_NAME
from roll.pipeline.base.training_config import TrainingRunConfig
from roll.pipeline.diffusion.flow_config import GROUP_ALGORITHMS, FlowArguments, check_flow_config
from roll.pipeline.diffusion.policy_gradient import PolicyGradientArguments
from roll.pipeline.diffusion.prompts import PromptDataArguments, load_prompts
from roll.pipeline.diffusion.sampling import SamplingArguments, gradient_step_mask
from roll.pipeline.diffusion.warm_start import WarmStartArguments
from roll.rewards.image_rewards import image_reward_class

NAME = check(pattern=r"[\w.]+", expect="a built-in reward name or a dotted path")


@dataclass
class RewardArguments:
    """The image reward (`roll.rewards.image_rewards`): a built-in name or an `ImageReward` subclass's dotted path,
    built with `kwargs`."""

    name: str = field(default="redness", metadata=NAME)
    kwargs: dict[str, Any] = field(
        default_factory=dict, metadata=any_value("the reward class's own arguments; its check_kwargs checks them")
    )


@dataclass
class RewardFLConfig(TrainingRunConfig):
    """Reward feedback learning: `actor` (a diffusers text-to-image model under a training strategy) samples images
    from prompts, a differentiable reward scores them, and the reward's gradient flows back through the last
    `sampling.grad_steps` denoising steps into `trainable_models`; `regulariser_weight` x the distance of the
    trained from the frozen noise prediction keeps the images near the start."""

    exp_name: str = field(default="reward_fl", metadata=check(EXP_NAME))
    # reward_fl back-propagates the reward (UNet or flow model); policy_gradient (DDPO: stochastic DDIM, group-
    # relative advantages, a clipped ratio) needs no gradient of the reward, on a UNet; flow_grpo (an SDE sampler)
    # and diffusion_nft (final samples only) are the flow models' counterparts.
    algorithm: Literal["reward_fl", "policy_gradient", "flow_grpo", "diffusion_nft"] = "reward_fl"
    policy: PolicyGradientArguments = field(default_factory=PolicyGradientArguments)
    flow: FlowArguments = field(default_factory=FlowArguments)
    trainable_models: list[str] = field(
        default_factory=lambda: ["unet"],
        metadata=check(
            nonempty=True,
            items=Rule(choices=(*TRAINABLE_PARTS, "transformer")),
            expect="unet and/or text_encoder, or transformer (flow models)",
        ),
    )
    sampling: SamplingArguments = field(default_factory=SamplingArguments)
    reward: RewardArguments = field(default_factory=RewardArguments)
    regulariser_weight: float = field(default=1.0, metadata=check(ge=0, hint="0 trains on the reward alone"))
    warm_start: WarmStartArguments = field(default_factory=WarmStartArguments)
    data: PromptDataArguments = field(default_factory=PromptDataArguments)  # type: ignore[assignment]
    max_response_length: int = field(default=8, metadata=checked_in_validate("images have no response tokens", 9))
    actor: WorkerConfig = field(default_factory=WorkerConfig)

    def sequence_lengths(self) -> tuple[int, int, int | None]:
        """Images have no token sequences (the actor's memory is `rank_breakdown`'s)."""
        return 0, 0, None

    def rank_breakdown(self, name: str, role: WorkerConfig, platform: str) -> RankBreakdown | None:
        """The actor's memory, counted from its diffusion model (`memory_estimate`), once per platform: the plan and
        the node estimate both ask."""
        from roll.pipeline.diffusion.memory_estimate import actor_breakdown

        if name != "actor":
            return None
        counted = self.__dict__.setdefault("_actor_breakdowns", {})
        if platform not in counted:
            counted[platform] = actor_breakdown(self, role, platform)
        return counted[platform]

    def batch_plan(self) -> list[str]:
        """One step's arithmetic: prompts per rank, micro-batches, denoising steps with and without gradient."""
        actor, args, sampling = self.actor, self.actor.training_args, self.sampling
        split = (
            f"{actor.dp_size} rank(s) x micro-batches of {args.per_device_train_batch_size} x "
            f"{args.gradient_accumulation_steps} accumulation"
        )
        if self.algorithm in GROUP_ALGORITHMS:
            sampler = (
                f"{sampling.num_inference_steps} denoising steps"
                if self.algorithm == "policy_gradient"
                else f"{self.flow.rollout_steps} SDE steps (noise level {self.flow.noise_level})"
            )
            update = "final samples only" if self.algorithm == "diffusion_nft" else "every step's log-probability"
            return [
                f"actor: {self.batch_size} prompts x {self.policy.group_size} stochastic samples in {sampler} (no "
                f"gradient), then one {self.algorithm} update on those rows = {split}, {update}; {self.max_steps} steps"
            ]
        return [
            f"actor: {self.batch_size} prompts per optimizer step = {split}; one image each in "
            f"{sampling.num_inference_steps} denoising steps, the last {sampling.grad_steps} with gradient; "
            f"{self.max_steps} steps"
        ]

    def validate(self) -> None:
        """The algorithm, the reward, the sampling window, the model (or its warm start), one step's rows, the data
        split and the checkpoint to resume from."""
        self.check_reward()
        if self.algorithm in ("policy_gradient", "flow_grpo") and self.regulariser_weight:
            raise ConfigError(
                f"regulariser_weight={self.regulariser_weight} applies to algorithm=reward_fl or diffusion_nft; "
                f"{self.algorithm}'s update is bounded by policy.clip_range: set regulariser_weight=0"
            )
        if self.max_response_length != 8:
            raise ConfigError(f"max_response_length={self.max_response_length} does not apply to images; remove it")
        if self.eval_batch_size:
            raise ConfigError(
                f"eval_batch_size={self.eval_batch_size} does not apply to Reward FL: the evaluation samples "
                "data.eval_images_per_prompt images of each of data.held_out_prompts prompts; set those instead"
            )
        super().validate()
        actor = self.actor
        self.check_trains("actor", actor)
        args = actor.training_args
        step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * actor.dp_size
        rows, spelled = self.batch_size, f"batch_size={self.batch_size}"
        if self.algorithm in GROUP_ALGORITHMS:
            rows *= self.policy.group_size
            spelled += f" x policy.group_size={self.policy.group_size}"
        if rows != step_rows:
            raise ConfigError(
                f"{spelled} must equal actor per_device_train_batch_size x gradient_accumulation_steps x dp size = "
                f"{step_rows}"
            )
        sampling = self.sampling
        if sampling.grad_steps > sampling.num_inference_steps:
            raise ConfigError(
                f"sampling.grad_steps={sampling.grad_steps} is more than sampling.num_inference_steps="
                f"{sampling.num_inference_steps}; lower grad_steps"
            )
        if sampling.min_timestep >= sampling.max_timestep:
            raise ConfigError(
                f"sampling.min_timestep={sampling.min_timestep} must be below sampling.max_timestep="
                f"{sampling.max_timestep}"
            )
        if self.actor.model_args.lora_rank > 0 and not {"unet", "transformer"} & set(self.trainable_models):
            raise ConfigError(
                "actor.model_args.lora_rank > 0 adapts the UNet (or a flow model's transformer), which "
                "trainable_models does not list; add unet (transformer) or set lora_rank=0"
            )
        if actor.max_tokens_per_microbatch is not None or actor.sequence_packing:
            raise ConfigError(
                f"actor.max_tokens_per_microbatch={actor.max_tokens_per_microbatch} and actor.sequence_packing="
                f"{actor.sequence_packing} must be null and false: the actor's rows are prompts whose images cost the "
                "same whatever their tokens, and a token budget would trim per-step tensors as if they were token "
                "columns"
            )
        self.check_model()
        check_flow_config(self)
        if self.algorithm == "reward_fl" and not self.flow_model:
            self.check_gradient_window()
        self.check_prompts()
        self.check_resume()

    def check_prompts(self) -> None:
        """The prompt file exists, and leaves a batch of training prompts beside the held-out ones."""
        data = self.data
        if data.prompt_file and not Path(data.prompt_file).is_file():
            raise ConfigError(
                f"data.prompt_file={data.prompt_file!r} is not a file: give a text file, one prompt a line"
            )
        prompts = len(load_prompts(data.prompt_file))
        if data.held_out_prompts >= prompts:
            raise ConfigError(
                f"data.held_out_prompts={data.held_out_prompts} leaves none of the {prompts} prompts for training; "
                "lower it or add prompts"
            )
        train_prompts = prompts - data.held_out_prompts
        if self.batch_size > train_prompts:
            raise ConfigError(
                f"batch_size={self.batch_size} is more than the {train_prompts} training prompts; lower batch_size "
                "or data.held_out_prompts"
            )

    def check_reward(self) -> None:
        """The reward exists, its kwargs can build it, and it has a gradient (Reward FL back-propagates it)."""
        try:
            reward = image_reward_class(self.reward.name)
            reward.check_kwargs(self.reward.kwargs, "reward.kwargs")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if not reward.differentiable and self.algorithm == "reward_fl":
            raise ConfigError(
                f"reward.name={self.reward.name!r} is not differentiable, and Reward FL back-propagates the reward "
                "through the denoising steps: choose a differentiable reward, or algorithm=policy_gradient "
                "(DDPO / Flow-GRPO style, which needs no gradient)"
            )

    def check_gradient_window(self) -> None:
        """The timestep window keeps the gradient through the last denoising step of the model's scheduler."""
        model = self.warm_start.base_model or self.actor.model_args.model_name_or_path
        scheduler = load_diffusion_scheduler(model)
        scheduler.set_timesteps(self.sampling.num_inference_steps)
        try:
            gradient_step_mask(scheduler.timesteps, self.sampling)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def flow_model(self) -> bool:
        """Whether the model trained (or warm-started) is a flow-matching one (a hub id is taken to be one)."""
        model = self.warm_start.base_model or self.actor.model_args.model_name_or_path
        return flow_family(model) is not None or is_hub_id(model)

    def check_model(self) -> None:
        """The actor's model exists, or the warm start will write it there from a base model that exists."""
        field_name, path = "actor.model_args.model_name_or_path", self.actor.model_args.model_name_or_path
        warm = self.warm_start
        if warm.base_model:
            if not warm.output_dir or Path(warm.output_dir).resolve() != Path(path).resolve():
                raise ConfigError(
                    f"warm_start.output_dir={warm.output_dir!r} must be {field_name}={path!r}, the model the warm "
                    "start writes and Reward FL trains; set both to one directory"
                )
            check_writable("warm_start.output_dir", warm.output_dir)
            field_name, path = "warm_start.base_model", warm.base_model
        if path.startswith(TINY_DIFFUSION_SCHEME):
            try:
                parse_tiny_diffusion(path)
            except ValueError as exc:
                raise ConfigError(f"{field_name}: {exc}") from exc
            return
        if is_hub_id(path) or flow_family(path):
            return  # a flow-matching pipeline: diffusers loads it (a hub id's files are checked when it loads)
        if not path or not Path(path).is_dir():
            raise ConfigError(
                f"{field_name}={path!r} is not a directory: give a diffusers text-to-image directory or a "
                "tiny-diffusion:// reference"
            )
        missing = check_diffusion_dir(path)
        if missing:
            raise ConfigError(
                f"{field_name}={path!r} is not a diffusers text-to-image directory: it has no {', '.join(missing)}/"
            )
