"""Config of the RLVR pipeline: roles, data, algorithm, schedule and outputs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from roll.algorithms.process_reward_losses import StepAggregate
from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.data_config import DataArguments
from roll.configs.schema import DOTTED_PATH, ConfigError, Rule, any_value, check, checked_in_validate
from roll.configs.worker_config import NAME, WORKER_CLS, WorkerConfig
from roll.datasets.step_dataset import separator_ids
from roll.distributed.strategy.registry import strategy_class
from roll.distributed.weight_sync.plan import SyncMethod, SyncPlan, devices_per_worker, plan_weight_sync
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import TINY_SCHEME
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.base.fault_tolerance_config import FaultToleranceArguments
from roll.pipeline.base.pipeline_config import EXP_NAME, PipelineConfig
from roll.pipeline.base.resumable import ResumableRun
from roll.pipeline.base.teacher_checks import (
    check_engine_scoring_temperature,
    check_same_vocabulary,
    check_teacher_model,
    check_teacher_strategy,
)
from roll.rewards.reward_process import import_reward_fn

# The advantage estimators that credit each token with its own reward (the others sum a sequence's rewards first).
TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "gae")
# The reward clusters that score responses with a trained reward model (`roll-rm`'s export) instead of a function:
# an outcome reward model (a score per response) and a process reward model (a score per step).
REWARD_MODEL_WORKER = "roll.pipeline.base.reward_model_worker.RewardModelWorker"
PROCESS_REWARD_SCORING_WORKER = "roll.pipeline.base.reward_model_worker.ProcessRewardScoringWorker"
REWARD_MODEL_WORKERS = (REWARD_MODEL_WORKER, PROCESS_REWARD_SCORING_WORKER)
# The head each reward-model cluster reads (transformers' architecture suffix) and the roll-rm run that exports it.
_REWARD_MODEL_HEADS = {
    REWARD_MODEL_WORKER: ("ForSequenceClassification", "reward model", "roll-rm"),
    PROCESS_REWARD_SCORING_WORKER: (
        "ForTokenClassification",
        "process reward model",
        "roll-rm --config-name rm_prm_arithmetic",
    ),
}


def _dotted_paths(value: str | list[str], path: str) -> None:
    """A dotted import path, or a non-empty list of distinct ones."""
    paths = [value] if isinstance(value, str) else value
    if not paths or len(set(paths)) != len(paths):
        raise ConfigError(f"{path}={value!r}: give one dotted path or a list of distinct ones")
    for i, item in enumerate(paths):
        DOTTED_PATH.check(item, path if isinstance(value, str) else f"{path}[{i}]")


def check_reward_model_dir(path: str, field_name: str, worker_cls: str = REWARD_MODEL_WORKER) -> None:
    """`path` is a model `worker_cls` reads: a config.json of the architecture of its head
    (*ForSequenceClassification for an outcome reward model, *ForTokenClassification for a process one) with one
    label."""
    head, kind, command = _REWARD_MODEL_HEADS[worker_cls]
    fix = f"set it to a model exported by `{command}` (<run_dir>/model)"
    if path.startswith(TINY_SCHEME):
        raise ConfigError(f"{field_name}={path!r} is a causal LM, not a reward model; {fix}")
    config_file = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field_name}={path!r}: no readable config.json ({exc}); {fix}") from exc
    architectures = config.get("architectures") or []
    # transformers writes num_labels as id2label (two labels when it has none).
    labels = len(config.get("id2label") or {}) or 2
    if any(name.endswith(head) for name in architectures) and labels == 1:
        return
    for other, (other_head, _, _) in _REWARD_MODEL_HEADS.items():
        if other != worker_cls and labels == 1 and any(name.endswith(other_head) for name in architectures):
            fix = f"{fix}, or set the cluster's worker_cls to {other}, which reads this model"
    raise ConfigError(
        f"{field_name}={path!r} is not a {kind}: architectures {architectures} with {labels} label(s), "
        f"not a *{head} with 1 label; {fix}"
    )


@dataclass
class RewardConfig(WorkerConfig):
    """A reward cluster: the samples of its `domains`, scored by `reward_fn` with a per-sample timeout.

    Several reward functions (a list in `reward_fn`) score a sample by their sum weighted by
    `reward_weights`. With `worker_cls` REWARD_MODEL_WORKER the cluster scores with the reward model in
    `model_args.model_name_or_path` on `strategy_args` (hf_infer) instead, and `reward_fn` is not used.
    """

    worker_cls: str = field(default="roll.pipeline.rlvr.reward_worker.RewardWorker", metadata=check(WORKER_CLS))
    world_size: int | None = field(default=1, metadata=check(ge=1))
    domains: list[str] = field(
        default_factory=lambda: ["math"],
        metadata=check(nonempty=True, items=NAME, expect="the domains this cluster scores, e.g. [math]"),
    )
    reward_fn: str | list[str] = field(
        default="roll.rewards.functions.math_reward", metadata=check(parse=_dotted_paths, bad="not valid!")
    )
    reward_weights: list[float] = field(
        default_factory=list,
        metadata=check(items=Rule(ge=0), hint="one weight per reward_fn entry; empty weighs each 1", bad=[-1.0]),
    )
    timeout_s: float = field(default=10.0, metadata=check(gt=0))
    # A process reward model (worker_cls PROCESS_REWARD_SCORING_WORKER): the text after each step, as in the data it
    # was trained on (data.step_separator of roll-rm); a response is split into steps there.
    step_separator: str = field(
        default="\n", metadata=check(nonempty=True, expect="the text after each step, e.g. '\\n' or ' ки'")
    )
    # A process reward model: a response's score, the min or the last of its steps' probabilities of being correct.
    step_aggregate: StepAggregate = "min"
    # A process reward model: on each step's last token, the change the step makes to the running step_aggregate,
    # for reinforce_plus_plus and gae (they sum to the score, which grpo and rloo read); false: the score on the
    # response's last token.
    step_rewards: bool = True

    @property
    def reward_fns(self) -> list[str]:
        """The reward functions' dotted paths."""
        return [self.reward_fn] if isinstance(self.reward_fn, str) else list(self.reward_fn)


@dataclass
class RLVRConfig(ResumableRun, PipelineConfig):
    """Reinforcement learning with verifiable rewards; the trained policy is exported as a HF directory."""

    exp_name: str = field(default="rlvr", metadata=check(EXP_NAME))
    pretrain: str = field(
        default="", metadata=any_value("only interpolated (${pretrain}) into model paths, which validate() checks")
    )
    max_steps: int = field(default=100, metadata=check(ge=1))
    # Prompts per step; each gets actor_infer's num_return_sequences samples.
    rollout_batch_size: int = field(default=32, metadata=check(ge=1))
    # Held-out accuracy every N steps (and before the first and after the last).
    eval_steps: int = field(default=10, metadata=check(ge=1))
    eval_batch_size: int = field(default=0, metadata=check(ge=0, hint="0 evaluates every held-out problem"))
    save_steps: int = field(default=0, metadata=check(ge=0, hint="0 saves only at the end"))
    # Checkpoints kept on disk: the newest N complete ones (the latest always); 0 keeps every one.
    keep_last_n: int = field(default=0, metadata=check(ge=0, hint="0 keeps every checkpoint"))
    # Restarts after a lost worker or node, and the stop on SIGTERM/SIGINT (docs/fault_tolerance.md).
    fault_tolerance: FaultToleranceArguments = field(default_factory=FaultToleranceArguments)
    # A checkpoint directory, or "latest" under run_dir/checkpoints, or "auto" (latest if there is one, else afresh).
    resume_from_checkpoint: str = field(
        default="", metadata=checked_in_validate("whether the checkpoint exists is the filesystem's", "step_999999")
    )
    # Where the trained policy is written at the end (a teacher for roll-distill, or a model to serve).
    export_dir: str = field(
        default="", metadata=any_value("any directory to write the model to; empty = <run_dir>/model")
    )
    num_log_samples: int = field(default=2, metadata=check(ge=0))
    weight_sync_bucket_mb: int = field(default=64, metadata=check(ge=1))
    # How actor_infer gets actor_train's weights: "auto" hands them over on shared devices and
    # broadcasts to workers elsewhere; "colocated" or "broadcast" force one route for every worker.
    weight_sync_method: SyncMethod = "auto"
    # k >= 1 generates the next batch while the current one trains (docs/performance.md, issue 12 item 4).
    # It is the pipeline's schedule, not the loss: which roles run at the same time, hence on which
    # devices they must be, is this config's to check; the loss side of it is algorithm.tis_cap.
    async_generation_ratio: int = field(
        default=0,
        metadata=check(
            ge=0, hint="0 generates and trains in turn; k >= 1 trains on samples at most k policy versions old"
        ),
    )
    data: DataArguments = field(default_factory=DataArguments)
    algorithm: AlgorithmArguments = field(default_factory=AlgorithmArguments)
    actor_train: WorkerConfig = field(default_factory=WorkerConfig)
    actor_infer: WorkerConfig = field(default_factory=WorkerConfig)
    reference: WorkerConfig | None = None
    critic: WorkerConfig | None = None
    # On-policy distillation (algorithm.teacher_kl_coef > 0): a frozen model of actor_train's tokenizer whose
    # log-probs of the samples give every response token a reward.
    teacher: WorkerConfig | None = None
    rewards: dict[str, RewardConfig] = field(
        default_factory=lambda: {"math": RewardConfig()},
        metadata=check(
            keys=Rule(pattern=r"\w[\w-]*", expect="a reward cluster name of letters, digits, '_' and '-'"),
            bad={"no spaces": {}},
            hint="at least one reward cluster, e.g. rewards.math, unless env is set",
        ),
    )
    # Multi-turn episodes of an environment instead of prompts scored by reward clusters (docs/agentic.md):
    # with it set, `data` and `rewards` are not used and no reward cluster starts.
    env: EnvArguments | None = None

    def reward_clusters(self) -> dict[str, RewardConfig]:
        """The reward clusters the run starts: none with an environment (it gives the rewards)."""
        return {} if self.env is not None else self.rewards

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

    def batch_plan(self) -> list[str]:
        """One RL step's arithmetic: prompts -> samples -> each role's shards, micro-batches and optimizer steps."""
        samples = self.rollout_batch_size * self.actor_infer.generating_args.num_return_sequences
        infer = self.actor_infer
        unit, sample = ("seeds", "episodes") if self.env is not None else ("prompts", "samples")
        lines = [
            f"rollout: {self.rollout_batch_size} {unit} x {infer.generating_args.num_return_sequences} {sample} "
            f"= {samples} samples per step",
            f"actor_infer: {self.rollout_batch_size // infer.dp_size} prompts per rank on {infer.dp_size} rank(s)",
        ]
        for name, role in (("actor_train", self.actor_train), ("critic", self.critic)):
            if role is None:
                continue
            args = role.training_args
            shard = samples // role.dp_size
            per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
            updates = samples // (per_step * role.dp_size) * self.algorithm.ppo_epochs
            lines.append(
                f"{name}: {shard} samples per rank on {role.dp_size} rank(s) -> micro-batches of "
                f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} accumulation = "
                f"{per_step} per optimizer step -> {updates} optimizer step(s) per RL step "
                f"({self.algorithm.ppo_epochs} epoch(s))"
            )
        for name, role in (("reference", self.reference), ("actor_train log-probs", self.actor_train)):
            if role is not None and (name != "reference" or self.algorithm.needs_reference):
                shard = samples // role.dp_size
                lines.append(
                    f"{name}: {shard} samples per rank in forward passes of {role.infer_batch_size} "
                    f"({-(-shard // role.infer_batch_size)} per rank)"
                )
        if self.env is not None:
            lines += self.env.describe(samples, infer.generating_args.max_new_tokens)
        for key, reward in self.reward_clusters().items():
            line = f"rewards.{key}: its domains' samples over {reward.world_size} worker(s)"
            if reward.worker_cls == PROCESS_REWARD_SCORING_WORKER:
                split = f"split into steps at {reward.step_separator!r}"
                given = "each step's reward on its last token" if reward.step_rewards else "the sample's score"
                line += f", {split}; the process reward model gives {given} (score: {reward.step_aggregate} step)"
            lines.append(line)
        return lines

    def sequence_lengths(self) -> tuple[int, int, int | None]:
        """The longest prompt, the generation budget (an episode's with env), and the prompts of one rollout."""
        if self.env is not None:
            return self.env.max_observation_tokens, self.env.max_trajectory_tokens, self.rollout_batch_size
        return self.data.max_prompt_length, self.actor_infer.generating_args.max_new_tokens, self.rollout_batch_size

    def roles(self) -> dict[str, WorkerConfig]:
        """The configured roles; with env set, without the reward clusters (they do not start)."""
        roles = super().roles()
        return {k: v for k, v in roles.items() if self.env is None or not k.startswith("rewards.")}

    def _check_vision_language_critic(self) -> None:
        """A critic over images would need a value head on a vision-language model, which roll does not build."""
        from roll.models.processors import is_vision_language

        if self.critic is not None and is_vision_language(self.critic.model_args.model_name_or_path):
            raise ConfigError(
                f"critic.model_args.model_name_or_path={self.critic.model_args.model_name_or_path!r} is a "
                "vision-language model, which roll loads as a policy only (no value head); use grpo, rloo or "
                "reinforce_plus_plus without a critic"
            )

    def validate(self) -> None:
        """Roles, their batch sizes and the algorithm's requirements; raise ConfigError naming the fix."""
        if self.teacher is not None:
            check_teacher_model("teacher", self.teacher)
        super().validate()
        self.weight_sync_plan(infer_tp_size=1)  # a route that cannot exist fails here, before any worker starts
        samples = self.rollout_batch_size * self.actor_infer.generating_args.num_return_sequences
        self.check_divisible("rollout_batch_size", self.rollout_batch_size, self.actor_infer)
        for role in (self.actor_train, self.reference, self.critic, self.teacher):
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
        self._check_vision_language_critic()
        if algorithm.adv_estimator in ("grpo", "rloo") and self.actor_infer.generating_args.num_return_sequences < 2:
            raise ConfigError(
                f"algorithm.adv_estimator={algorithm.adv_estimator} compares samples of one prompt: "
                "set actor_infer.generating_args.num_return_sequences to 2 or more"
            )
        if algorithm.needs_reference and self.reference is None:
            raise ConfigError("a KL loss or KL penalty needs the reference role; configure reference or set the KL off")
        self._check_loss_variants()
        self._check_teacher()
        self._check_engine_scorers()
        self._check_async_generation()
        self._check_dynamic_sampling()
        if self.env is None and not self.rewards:
            raise ConfigError("rewards: configure at least one reward cluster, e.g. rewards.math, or set env")
        for key, reward in self.reward_clusters().items():
            if reward.worker_cls in REWARD_MODEL_WORKERS:
                self._check_reward_model(key, reward)
                continue
            for dotted in reward.reward_fns:
                try:
                    import_reward_fn(dotted)
                except ValueError as exc:
                    raise ConfigError(f"rewards.{key}.reward_fn: {exc}") from exc
            if reward.reward_weights and len(reward.reward_weights) != len(reward.reward_fns):
                raise ConfigError(
                    f"rewards.{key}.reward_weights has {len(reward.reward_weights)} weights for "
                    f"{len(reward.reward_fns)} reward_fn entries; give one weight per entry, or none to weigh each 1"
                )
        domains = [d for reward in self.reward_clusters().values() for d in reward.domains]
        if len(domains) != len(set(domains)):
            raise ConfigError(f"rewards: every domain must be served by exactly one reward cluster, got {domains}")
        self._check_inputs()

    def _check_reward_model(self, key: str, reward: RewardConfig) -> None:
        """A reward-model cluster runs an inference strategy over an exported reward model."""
        strategy = reward.strategy_args.strategy_name if reward.strategy_args else None
        if strategy is None or strategy_class(strategy).trains():
            raise ConfigError(
                f"rewards.{key}.strategy_args.strategy_name={strategy}: a reward-model cluster needs an inference "
                "strategy; set it to hf_infer"
            )
        path = reward.model_args.model_name_or_path
        check_reward_model_dir(path, f"rewards.{key}.model_args.model_name_or_path", reward.worker_cls)
        if reward.max_tokens_per_microbatch is not None:
            raise ConfigError(
                f"rewards.{key}.max_tokens_per_microbatch must be null: a token budget may pack rows into one, "
                "and a reward model's score is read at each row's last token"
            )
        if reward.reward_weights:
            raise ConfigError(
                f"rewards.{key}.reward_weights weighs reward_fn entries, but a reward-model cluster scores with its "
                "model alone; leave reward_weights empty"
            )
        if reward.worker_cls == PROCESS_REWARD_SCORING_WORKER:
            self._check_step_rewards(key, reward)

    def _check_step_rewards(self, key: str, reward: RewardConfig) -> None:
        """The separator has tokens; per-step rewards come from the only reward cluster (other clusters' scores
        would have no steps to join)."""
        path = reward.model_args.model_name_or_path
        separator_ids(load_tokenizer(path), reward.step_separator, f"rewards.{key}.step_separator")
        if not reward.step_rewards:
            return
        others = sorted(set(self.reward_clusters()) - {key})
        if others:
            raise ConfigError(
                f"rewards.{key}.step_rewards=true gives per-step rewards, which the scores of rewards.{others[0]} "
                f"cannot join; set rewards.{key}.step_rewards=false, or score every domain with rewards.{key}"
            )

    def _check_teacher(self) -> None:
        """On-policy distillation: a teacher scoring given sequences in actor_train's vocabulary, token-level
        advantages, and some reward left."""
        algorithm = self.algorithm
        if self.teacher is None:
            if algorithm.needs_teacher:
                raise ConfigError(
                    f"algorithm.teacher_kl_coef={algorithm.teacher_kl_coef} needs the teacher role; configure teacher "
                    "(see examples/config/distill_onpolicy_arithmetic.yaml) or set algorithm.teacher_kl_coef=0"
                )
            return
        if not algorithm.needs_teacher:
            raise ConfigError(
                "teacher is configured but algorithm.teacher_kl_coef=0 would never read it; set a coefficient "
                "(e.g. algorithm.teacher_kl_coef=1.0) or teacher=null"
            )
        if algorithm.adv_estimator not in TOKEN_LEVEL_ESTIMATORS:
            raise ConfigError(
                f"algorithm.adv_estimator={algorithm.adv_estimator} sums a sequence's rewards into one score, which "
                "would blur the teacher's per-token signal; use reinforce_plus_plus (or gae with a critic)"
            )
        check_teacher_strategy(self.teacher)
        check_same_vocabulary(self.teacher, self.actor_train)

    def _check_engine_scorers(self) -> None:
        """A reference or teacher on an engine (vllm, sglang) scores at temperature 1, the model's own distribution."""
        generating = self.actor_infer.generating_args
        scaled = self.algorithm.log_prob_temperature == "sampling" and generating.do_sample
        roles = self.trainer_side_roles()
        for name in ("reference", "teacher"):
            if name in roles:
                check_engine_scoring_temperature(roles[name], generating.temperature if scaled else 1.0)

    def _check_loss_variants(self) -> None:
        """The overlong buffer within the generation budget; TIS with an engine that returns its log-probs."""
        algorithm, generating = self.algorithm, self.actor_infer.generating_args
        buffer_len = algorithm.overlong_buffer_len
        if buffer_len is not None and buffer_len > generating.max_new_tokens:
            raise ConfigError(
                f"algorithm.overlong_buffer_len={buffer_len} exceeds actor_infer.generating_args.max_new_tokens="
                f"{generating.max_new_tokens}; set it to at most max_new_tokens (DAPO: a fraction of it)"
            )
        if algorithm.tis_cap is None:
            return
        strategy = self.actor_infer.strategy_args.strategy_name if self.actor_infer.strategy_args else None
        if strategy is None or not hasattr(strategy_class(strategy), "generate_with_log_probs"):
            raise ConfigError(
                f"algorithm.tis_cap needs the engine's own log-probs, which actor_infer strategy {strategy!r} does "
                "not return; use strategy hf_infer, vllm or sglang for actor_infer, or set algorithm.tis_cap to null"
            )
        if algorithm.log_prob_temperature == "sampling" and generating.temperature != 1.0:
            raise ConfigError(
                "algorithm.tis_cap compares with the engine's log-probs before temperature, but "
                f"algorithm.log_prob_temperature=sampling scores at temperature {generating.temperature}; "
                "set algorithm.log_prob_temperature=one"
            )

    def trainer_side_roles(self) -> dict[str, WorkerConfig]:
        """The model roles a run uses besides actor_infer: actor_train, and the reference, critic and teacher if needed.

        The algorithm needs the reference for a KL term, the critic for GAE and the teacher for on-policy
        distillation. With async_generation_ratio >= 1 these roles work while actor_infer generates.
        """
        roles = {"actor_train": self.actor_train}
        if self.reference is not None and self.algorithm.needs_reference:
            roles["reference"] = self.reference
        if self.critic is not None and self.algorithm.adv_estimator == "gae":
            roles["critic"] = self.critic
        if self.teacher is not None and self.algorithm.needs_teacher:
            roles["teacher"] = self.teacher
        return roles

    def _check_dynamic_sampling(self) -> None:
        """Dynamic sampling compares the samples of a prompt, and refills only a batch generated in the step."""
        algorithm = self.algorithm
        if not algorithm.dynamic_sampling:
            return
        n = self.actor_infer.generating_args.num_return_sequences
        if n < 2:
            raise ConfigError(
                f"algorithm.dynamic_sampling keeps the prompts whose samples disagree, and with "
                f"actor_infer.generating_args.num_return_sequences={n} every prompt would be dropped; "
                "set num_return_sequences to 2 or more"
            )
        if algorithm.dynamic_sampling_max_rounds > 1 and self.async_generation_ratio:
            raise ConfigError(
                f"algorithm.dynamic_sampling_max_rounds={algorithm.dynamic_sampling_max_rounds} generates more "
                f"within the step, which async_generation_ratio={self.async_generation_ratio} overlaps with "
                "training; set one of them to 1 / 0"
            )

    def _check_async_generation(self) -> None:
        """Overlapped generation needs actor_infer on devices of its own and the TIS correction."""
        k = self.async_generation_ratio
        if not k:
            return
        infer, roles = set(self.actor_infer.devices), self.trainer_side_roles()
        used = {d for role in roles.values() for d in role.devices}
        for name, role in roles.items():
            shared = sorted(infer & set(role.devices))
            if shared:
                free = sorted(set(range(self.total_devices)) - used)
                fix = f"e.g. actor_infer.device_mapping={free}" if free else "move them to fewer devices first"
                raise ConfigError(
                    f"async_generation_ratio={k} runs actor_infer while {name} works, but both use device(s) {shared}; "
                    f"set actor_infer.device_mapping to devices that {', '.join(roles)} do not use ({fix}), "
                    "or async_generation_ratio=0"
                )
        if self.algorithm.tis_cap is None:
            raise ConfigError(
                f"async_generation_ratio={k} trains on samples of a policy up to {k} version(s) old; set "
                "algorithm.tis_cap (e.g. 2.0) to weight them by the truncated ratio to the sampling policy"
            )

    def _check_inputs(self) -> None:
        """Model directories, lengths, data, memory and the checkpoint to resume from."""
        facts = self.check_models(self.roles().values())
        model_facts = {name: facts[name] for name, role in self.roles().items() if not isinstance(role, RewardConfig)}
        generating = self.actor_infer.generating_args
        if self.env is not None:
            self._check_env_inputs(facts, model_facts)
            return
        tokens = self.data.max_prompt_length + generating.max_new_tokens
        self.check_lengths(
            model_facts,
            tokens,
            f"data.max_prompt_length={self.data.max_prompt_length} + "
            f"actor_infer.generating_args.max_new_tokens={generating.max_new_tokens}",
        )
        train, held_out = self.check_data(
            self.data, self.rollout_batch_size, "rollout_batch_size", self.actor_train.model_args.model_name_or_path
        )
        served = {domain for reward in self.rewards.values() for domain in reward.domains}
        unserved = sorted({example.domain for example in (*train, *held_out)} - served)
        if unserved:
            raise ConfigError(
                f"the data has domain(s) {unserved} that no reward cluster scores; add each to the domains of a "
                f"rewards.* cluster (served now: {sorted(served)})"
            )
        evaluated = min(len(held_out), self.eval_batch_size or len(held_out))
        lower = (
            "actor_infer.generating_args.max_new_tokens, actor_infer.infer_batch_size or "
            "actor_infer.generating_args.num_return_sequences"
        )
        for prompts, samples in ((self.rollout_batch_size, generating.num_return_sequences), (evaluated, 1)):
            self.check_generation_memory(self.actor_infer, facts["actor_infer"], prompts, samples, tokens, lower)
        self.check_resume()

    def _check_env_inputs(self, facts: dict, model_facts: dict) -> None:
        """With an environment: it resolves (or an agent's data rows read), one episode (first observation +
        trajectory) fits every model and budget, and the episodes of a rollout fit the generation memory."""
        env, generating = self.env, self.actor_infer.generating_args
        assert env is not None
        env.validate(generating.max_new_tokens)
        if env.agent_task == "data":
            from roll.pipeline.agentic.agent_tasks import DataTasks

            DataTasks.load(self.data, env)  # the rows the agent plays: a wrong file or column fails here, before Ray
        if env.apply_chat_template:
            model = self.actor_infer.model_args.model_name_or_path
            env.check_chat_template(load_tokenizer(model), model)
        tokens = env.max_observation_tokens + env.max_trajectory_tokens
        self.check_lengths(
            model_facts,
            tokens,
            f"env.max_observation_tokens={env.max_observation_tokens} + "
            f"env.max_trajectory_tokens={env.max_trajectory_tokens}",
        )
        lower = "env.max_trajectory_tokens, actor_infer.infer_batch_size or num_return_sequences"
        for prompts, samples in ((self.rollout_batch_size, generating.num_return_sequences), (env.eval_episodes, 1)):
            self.check_generation_memory(self.actor_infer, facts["actor_infer"], prompts * samples, 1, tokens, lower)
        self.check_resume()
