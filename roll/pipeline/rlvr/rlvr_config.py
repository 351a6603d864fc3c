"""Config of the RLVR pipeline: roles, data, algorithm, schedule and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.data_config import DataArguments
from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.distributed.weight_sync.plan import SyncMethod, SyncPlan, devices_per_worker, plan_weight_sync
from roll.pipeline.base_config import PipelineConfig
from roll.rewards.sandbox import import_reward_fn


@dataclass
class RewardConfig(WorkerConfig):
    """A reward cluster: the samples of its `domains`, scored by `reward_fn` with a per-sample timeout."""

    worker_cls: str = "roll.pipeline.rlvr.reward_worker.RewardWorker"
    world_size: int | None = 1
    domains: list[str] = field(default_factory=lambda: ["math"])
    reward_fn: str = "roll.rewards.functions.math_reward"
    timeout_s: float = 10.0


@dataclass
class RLVRConfig(PipelineConfig):
    """Reinforcement learning with verifiable rewards."""

    exp_name: str = "rlvr"
    pretrain: str = ""
    max_steps: int = 100
    rollout_batch_size: int = 32  # prompts per step; each gets actor_infer's num_return_sequences samples
    eval_steps: int = 10  # held-out accuracy every N steps (and before the first and after the last)
    eval_batch_size: int = 0  # held-out problems per evaluation; 0 = all
    save_steps: int = 0  # checkpoint every N steps; 0 = only at the end
    resume_from_checkpoint: str = ""  # a checkpoint directory, or "latest" under output_dir/checkpoints
    num_log_samples: int = 2
    weight_sync_bucket_mb: int = 64
    # How actor_infer gets actor_train's weights: "auto" hands them over on shared devices and
    # broadcasts to workers elsewhere; "colocated" or "broadcast" force one route for every worker.
    weight_sync_method: SyncMethod = "auto"
    data: DataArguments = field(default_factory=DataArguments)
    algorithm: AlgorithmArguments = field(default_factory=AlgorithmArguments)
    actor_train: WorkerConfig = field(default_factory=WorkerConfig)
    actor_infer: WorkerConfig = field(default_factory=WorkerConfig)
    reference: WorkerConfig | None = None
    critic: WorkerConfig | None = None
    rewards: dict[str, RewardConfig] = field(default_factory=lambda: {"math": RewardConfig()})

    def weight_sync_plan(self, infer_tp_size: int) -> SyncPlan:
        """Which actor_train rank feeds which actor_infer worker (see roll.distributed.weight_sync.plan)."""
        train, infer = self.actor_train, self.actor_infer
        try:
            return plan_weight_sync(
                devices_per_worker(train.devices, train.num_devices_per_worker) or [[]] * train.world_size,
                devices_per_worker(infer.devices, infer.num_devices_per_worker) or [[]] * infer.world_size,
                infer_tp_size,
                self.weight_sync_method,
            )
        except ValueError as exc:
            raise ConfigError(f"weight_sync_method={self.weight_sync_method}: {exc}") from exc

    def validate(self) -> None:
        """Roles, their batch sizes and the algorithm's requirements; raise ConfigError naming the fix."""
        super().validate()
        self.weight_sync_plan(infer_tp_size=1)  # a route that cannot exist fails here, before any worker starts
        if self.weight_sync_bucket_mb < 1:
            raise ConfigError(f"weight_sync_bucket_mb={self.weight_sync_bucket_mb} must be at least 1")
        samples = self.rollout_batch_size * self.actor_infer.generating_args.num_return_sequences
        self.check_divisible("rollout_batch_size", self.rollout_batch_size, self.actor_infer)
        for role in (self.actor_train, self.reference, self.critic):
            if role is not None:
                self.check_divisible("rollout_batch_size x num_return_sequences", samples, role)
        args = self.actor_train.training_args
        step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.actor_train.dp_size
        if samples % step_rows:
            raise ConfigError(
                f"a rollout of {samples} samples is not a whole number of optimizer steps of {step_rows} rows "
                f"(actor_train per_device_train_batch_size x gradient_accumulation_steps x dp size)"
            )
        algorithm = self.algorithm
        if algorithm.adv_estimator == "gae" and self.critic is None:
            raise ConfigError("algorithm.adv_estimator=gae needs a critic role; configure critic or use grpo")
        if algorithm.adv_estimator in ("grpo", "rloo") and self.actor_infer.generating_args.num_return_sequences < 2:
            raise ConfigError(
                f"algorithm.adv_estimator={algorithm.adv_estimator} compares samples of one prompt: "
                "set actor_infer.generating_args.num_return_sequences to 2 or more"
            )
        if algorithm.needs_reference and self.reference is None:
            raise ConfigError("a KL loss or KL penalty needs the reference role; configure reference or set the KL off")
        for key, reward in self.rewards.items():
            try:
                import_reward_fn(reward.reward_fn)
            except ValueError as exc:
                raise ConfigError(f"rewards.{key}.reward_fn: {exc}") from exc
        domains = [d for reward in self.rewards.values() for d in reward.domains]
        if not self.rewards or len(domains) != len(set(domains)):
            raise ConfigError(f"rewards: every domain must be served by exactly one reward cluster, got {domains}")
