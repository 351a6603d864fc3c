"""The RLVR driver loop: generate, reward, score, compute advantages, update; one phase at a time."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from roll.algorithms.kl import AdaptiveKLController, FixedKLController
from roll.configs.worker_config import GeneratingArguments
from roll.datasets.prompt_dataset import encode_prompts, load_splits, make_sampler, pad_token_id
from roll.distributed.executor.weight_syncer import WeightSyncer
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.engine_strategy import generation_stop_ids
from roll.distributed.strategy.response_scores import LOG_PROB_TEMPERATURE
from roll.models.model_providers import load_tokenizer
from roll.models.processors import processor_for
from roll.models.tiny import resolve_model_path
from roll.models.vision_inputs import IMAGE_KEYS
from roll.pipeline.agentic.endpoint_template import export_chat_template
from roll.pipeline.agentic.env_rollout import EnvRollouts, EpisodeSeeds
from roll.pipeline.base import checkpoint_state
from roll.pipeline.base.evaluation import answer_scorer, greedy_accuracy
from roll.pipeline.base.pipeline import BasePipeline
from roll.pipeline.base.preemption import Preempted
from roll.pipeline.base.residency import Phase
from roll.pipeline.base.rl_workers import MAX_RESPONSE_LENGTH, WITH_ENGINE_LOG_PROBS
from roll.pipeline.rlvr import phases, step_plan
from roll.pipeline.rlvr.async_generation import (
    BackgroundCall,
    InFlightRollout,
    PolicyVersions,
    load_in_flight,
    save_in_flight,
)
from roll.pipeline.rlvr.rlvr_config import REWARD_MODEL_WORKERS, RLVRConfig
from roll.pipeline.rlvr.rollout import (
    add_overlong_penalty,
    append_round,
    compute_advantages,
    informative_rows,
    keep_informative_groups,
    mask_truncated_responses,
    pad_rows,
    rollout_groups,
)
from roll.utils.tracking import MetricsTracker, show_progress, timed_evaluation

logger = logging.getLogger(__name__)

# meta_info key of an episode batch: the rollout's metrics (success, turns, tool use), logged with its step.
EPISODE_METRICS = "episode_metrics"
# Driver state key: the step and policy version of the batch in flight when the checkpoint was saved (or None).
IN_FLIGHT = "in_flight"


class RLVRPipeline(BasePipeline):
    """Reinforcement learning with verifiable rewards over the configured roles."""

    config: RLVRConfig

    def __init__(self, config: RLVRConfig) -> None:
        super().__init__(config)
        for role in config.roles().values():
            resolve_model_path(role.model_args.model_name_or_path)  # build tiny models once, here
        self.tokenizer = load_tokenizer(config.actor_train.model_args.model_name_or_path)
        self.pad_id = pad_token_id(self.tokenizer)
        algorithm = config.algorithm
        self.env_rollouts: EnvRollouts | None = None
        if config.env is not None:  # episodes instead of prompts: no reward clusters (data only for an agent's tasks)
            self.train_examples, self.eval_examples = [], []
            self.sampler = EpisodeSeeds(config.rollout_batch_size, config.env.eval_seed_offset)
            self.env_rollouts = EnvRollouts(
                config.env,
                self.tokenizer,
                self.pad_id,
                config.actor_infer.generating_args,
                algorithm.tis_cap is not None,
                generation_stop_ids(resolve_model_path(config.actor_infer.model_args.model_name_or_path)),
                data=config.data,
            )
        else:
            self.train_examples, self.eval_examples = load_splits(
                config.data, self.tokenizer, processor=processor_for(config.actor_train.model_args.model_name_or_path)
            )
            if config.eval_batch_size:
                self.eval_examples = self.eval_examples[: config.eval_batch_size]
            self.sampler = make_sampler(
                self.train_examples, config.rollout_batch_size, config.seed, config.data.domain_weights
            )
        # Answers are checked by the reward functions; a reward model's score is no verdict, so runs scored by reward
        # models alone check them as SFT does, held-out and in `rollout/accuracy` (a learnt reward can rise while the
        # answers it pays for do not).
        model_scored = all(r.worker_cls in REWARD_MODEL_WORKERS for r in config.reward_clusters().values())
        self.answer_check = answer_scorer(self.tokenizer) if model_scored and config.env is None else None
        self.eval_score = self.answer_check or self.score
        self.kl_controller = (
            AdaptiveKLController(algorithm.kl_penalty_coef, algorithm.adaptive_kl_target, algorithm.adaptive_kl_horizon)
            if algorithm.adaptive_kl_target is not None
            else FixedKLController(algorithm.kl_penalty_coef)
        )
        sampling = config.actor_infer.generating_args
        scaled = algorithm.log_prob_temperature == "sampling" and sampling.do_sample
        self.log_prob_temperature = sampling.temperature if scaled else 1.0
        self.run_dir = Path(config.run_dir)
        # The roles that score, value or train the batch: which of them are configured decides the step's passes.
        self.trainer_roles = config.trainer_side_roles()
        names = ["actor_train", "actor_infer", *(r for r in self.trainer_roles if r != "actor_train")]
        self.start_roles(names + [f"rewards.{key}" for key in config.reward_clusters()])
        infer = self.clusters["actor_infer"]
        self.weight_syncer = WeightSyncer(
            self.clusters["actor_train"],
            infer,
            config.weight_sync_plan(infer.weight_sync_shards()),
            config.weight_sync_bucket_mb * 2**20,
        )
        self.weights_stale = False
        self.versions = PolicyVersions(config.async_generation_ratio)
        # With async_generation_ratio >= 1: the next step's generation, running while this step trains.
        self.in_flight: InFlightRollout | None = None

    # ---- one step -------------------------------------------------------------------------

    def sync_weights(self) -> dict[str, float]:
        """Bring actor_infer up to actor_train's weights if an update made them stale; return the sync's metrics.

        The weights travel along the routes of the weight-sync plan (`weight_sync_method`).
        """
        if not self.weights_stale:
            return {}
        metrics: dict[str, float] = {}
        with self.residency.timed(phases.SYNC_WEIGHTS, metrics):
            metrics.update(self.weight_syncer.sync())
        self.weights_stale = False
        self.versions.synced()
        return metrics

    def score(self, batch: DataProto) -> torch.Tensor:
        """Scores of every row from the reward cluster of its domain (rows keep their order)."""
        return self._rewards(batch).batch["scores"]

    def _rewards(self, batch: DataProto) -> DataProto:
        domains = batch.non_tensor_batch["domain"]
        parts, futures = [], []
        for key, reward in self.config.rewards.items():
            rows = torch.tensor([i for i, d in enumerate(domains) if d in reward.domains], dtype=torch.long)
            if len(rows):
                padded, pad = batch[rows].pad_to_divisor(self.clusters[f"rewards.{key}"].world_size)
                futures.append((self.clusters[f"rewards.{key}"].compute_rewards(padded, blocking=False), pad))
                parts.append(rows)
        unserved = set(domains) - {d for r in self.config.rewards.values() for d in r.domains}
        if unserved:
            raise ValueError(f"no reward cluster serves domain(s) {sorted(unserved)}; add them to a rewards.*.domains")
        results = [future.get().unpad(pad) for future, pad in futures]
        order = torch.argsort(torch.cat(parts))
        return DataProto.concat(results)[order]

    def _generation_request(self, step: int, round_: int = 0) -> tuple[DataProto, GeneratingArguments]:
        """The next prompts from the sampler and the sampling arguments of `step` (seeded by it, and by the
        dynamic-sampling round after the first)."""
        prompts = encode_prompts(self.sampler.next_batch(), self.pad_id)
        prompts.meta_info[WITH_ENGINE_LOG_PROBS] = self.config.algorithm.tis_cap is not None
        seed = self.config.seed + step + round_ * (self.config.max_steps + 1)
        return prompts, replace(self.config.actor_infer.generating_args, seed=seed)

    def _as_rollout(self, batch: DataProto) -> DataProto:
        """`batch` as generated, with what the passes and the loss read from `meta_info`."""
        batch.meta_info[LOG_PROB_TEMPERATURE] = self.log_prob_temperature
        batch.meta_info[MAX_RESPONSE_LENGTH] = self.config.actor_infer.generating_args.max_new_tokens
        return batch

    def _launch(self, step: int) -> InFlightRollout:
        """Start generating `step`'s batch with actor_infer's current weights (non-blocking): its prompts, or
        (with `env`) its episodes, played in a thread of the driver."""
        if self.env_rollouts is not None:
            seeds = self.sampler.next_batch()
            future = BackgroundCall(lambda: self._episodes(seeds, step))
        else:
            prompts, generating_args = self._generation_request(step)
            future = self.clusters["actor_infer"].generate(prompts, generating_args, blocking=False)
        return InFlightRollout(step, future, self.versions.served)

    def _generate_now(self, step: int) -> DataProto:
        """`step`'s batch generated with actor_infer's current weights, waited for."""
        if self.env_rollouts is not None:
            return self._episodes(self.sampler.next_batch(), step)
        prompts, generating_args = self._generation_request(step)
        return self.clusters["actor_infer"].generate(prompts, generating_args)

    def _rollout(self, step: int, metrics: dict[str, float], timings: dict[str, float]) -> DataProto:
        """`step`'s generated batch; its weight sync and generation times go to `metrics` and `timings`.

        Synchronous (async_generation_ratio 0): sync, then generate and wait. Overlapped: wait for the
        batch started during the previous step (`time/generate_s` is then only the wait), sync while
        actor_infer is idle, and start the next step's batch before this one trains.
        """
        if not self.config.async_generation_ratio:
            metrics.update(self.sync_weights())
            with self.residency.timed(phases.GENERATE, timings):
                return self._as_rollout(self._generate_now(step))
        if self.in_flight is None:  # the first step, or the first after a resume
            metrics.update(self.sync_weights())
            self.in_flight = self._launch(step)
        with self.residency.timed(phases.GENERATE, timings):
            batch = self._as_rollout(self.in_flight.result())
        self.in_flight = None
        metrics.update(self.sync_weights())
        if step < self.config.max_steps:
            self.in_flight = self._launch(step + 1)
        metrics.update(self.versions.staleness_metrics(batch))
        return batch

    def step(self, step: int) -> dict[str, float]:
        """One RL step through the phases; return its metrics, the phase timings last."""
        metrics: dict[str, float] = {}
        timings: dict[str, float] = {}
        if self.env_rollouts is not None:
            batch = self.play_episodes(step, metrics, timings)
        else:
            batch = self._rollout(step, metrics, timings)
            batch = self.score_rollout(batch, step, metrics, timings)
        batch, group_index = self.filter_groups(batch, step, metrics, timings)
        if len(batch) == 0:  # dynamic sampling kept no group
            return metrics | timings
        batch = self.log_prob_passes(batch, timings)
        batch = self.values(batch, timings)
        batch = self.advantages(batch, group_index, metrics, timings)
        self.update(batch, metrics, timings)
        return metrics | timings

    def score_rollout(
        self, batch: DataProto, step: int, metrics: dict[str, float], timings: dict[str, float]
    ) -> DataProto:
        """`batch` scored (`_scored`); logs the rollout's metrics and a few samples."""
        batch = self._scored(batch, metrics, timings)
        metrics.update(self._rollout_metrics(batch))
        self._log_samples(batch, step)
        return batch

    def _scored(self, batch: DataProto, metrics: dict[str, float], timings: dict[str, float]) -> DataProto:
        """`batch` with its rows' `scores` (plus the overlong penalty, if configured), `reward_failed`,
        `response_text` and any per-step rewards from the reward clusters."""
        with self.residency.timed(phases.REWARDS, timings):
            rewards = self._rewards(batch)
            # A process reward model's step rewards come as `turn_rewards` (the multi-turn layout).
            keys = [k for k in ("scores", "reward_failed", "turn_rewards", "turn_discounts") if k in rewards.batch]
            batch = batch.union(rewards.select(batch_keys=keys))
            batch.non_tensor_batch["response_text"] = rewards.non_tensor_batch["response_text"]
        algorithm = self.config.algorithm
        if algorithm.overlong_buffer_len is not None:
            max_new_tokens = self.config.actor_infer.generating_args.max_new_tokens
            metrics["rollout/overlong_penalty_mean"] = add_overlong_penalty(batch, max_new_tokens, algorithm)
        return batch

    def filter_groups(
        self, batch: DataProto, step: int, metrics: dict[str, float], timings: dict[str, float]
    ) -> tuple[DataProto, torch.Tensor]:
        """`batch` and the prompt group of each row; with dynamic sampling, only whole informative groups (maybe
        none), as many as every role that takes the batch accepts. With `dynamic_sampling_max_rounds` > 1,
        more prompts are generated and scored (with the same weights) until the informative rows fill the
        batch or the rounds run out. A batch of agent episodes, a row per segment, is padded to whole shards of
        the roles (`pad_rows`)."""
        n = self.config.actor_infer.generating_args.num_return_sequences
        group_index = rollout_groups(batch, n)
        algorithm = self.config.algorithm
        row_multiple = step_plan.dynamic_sampling_row_multiple(self.trainer_roles)
        if not algorithm.dynamic_sampling:
            return pad_rows(batch, group_index, row_multiple)
        target, rounds = len(batch), 1
        while (
            rounds < algorithm.dynamic_sampling_max_rounds
            and informative_rows(batch, group_index, self._failed_episodes(batch)) < target
        ):
            more = self._refill(step, rounds, metrics, timings)
            batch, group_index = append_round(batch, group_index, more, n, self.pad_id)
            rounds += 1
        batch, group_index, kept = keep_informative_groups(
            batch, group_index, row_multiple, max_rows=target, excluded=self._failed_episodes(batch)
        )
        metrics.update(kept)
        metrics["rollout/generation_rounds"] = float(rounds)
        return pad_rows(batch, group_index, row_multiple)

    def _refill(self, step: int, round_: int, metrics: dict[str, float], timings: dict[str, float]) -> DataProto:
        """Dynamic sampling's next round, scored: the sampler's next prompts, or (with `env`) episodes of its next
        seeds, generated with the weights of this step and sampling seeds of their own."""
        if self.env_rollouts is None:
            with self.residency.timed(phases.GENERATE, timings):
                prompts, generating_args = self._generation_request(step, round_)
                more = self._as_rollout(self.clusters["actor_infer"].generate(prompts, generating_args))
            return self._scored(more, metrics, timings)
        with self.residency.timed(phases.GENERATE, timings):
            more = self._as_rollout(self._episodes(self.sampler.next_batch(), step, round_))
        more.meta_info.pop(EPISODE_METRICS)  # the step's rollout metrics are those of its first round
        return self._scored_episodes(more, metrics)

    def _failed_episodes(self, batch: DataProto) -> torch.Tensor | None:
        """With `env`, the episodes an environment error ended (bool `[B]`): they have no real reward, so they are
        left out of dynamic sampling's verdict, their group's statistics and the loss. None without `env`."""
        return batch.batch["reward_failed"].bool() if self.env_rollouts is not None else None

    def log_prob_passes(self, batch: DataProto, timings: dict[str, float]) -> DataProto:
        """`batch` with the reference's, the teacher's and actor_train's (old) log-probs of the passes that run;
        the reference's and actor_train's at the same time when they can."""
        old_log_probs = step_plan.needs_old_log_prob_pass(self.config.algorithm, self.config.actor_train, len(batch))
        passes = step_plan.log_prob_passes(self.trainer_roles, old_log_probs)
        clusters, timed = self.clusters, self.residency.timed
        if step_plan.runs_concurrently(passes, self.trainer_roles):
            with timed(phases.REFERENCE_AND_OLD_LOG_PROBS, timings):
                futures = [(key, clusters[role].compute_log_probs(batch, blocking=False)) for role, _, key in passes]
                for key, future in futures:
                    batch = batch.union(future.get().rename("log_probs", key))
            return batch
        for role, phase, key in passes:
            with timed(phase, timings):
                batch = batch.union(clusters[role].compute_log_probs(batch).rename("log_probs", key))
        return batch

    def values(self, batch: DataProto, timings: dict[str, float]) -> DataProto:
        """`batch` with the critic's values, when a critic trains (GAE)."""
        if "critic" not in self.clusters:
            return batch
        with self.residency.timed(phases.VALUES, timings):
            return batch.union(self.clusters["critic"].compute_values(batch))

    def advantages(
        self, batch: DataProto, group_index: torch.Tensor, metrics: dict[str, float], timings: dict[str, float]
    ) -> DataProto:
        """`batch` with its token rewards, advantages and returns; the KL controller follows the measured KL."""
        with self.residency.timed(phases.ADVANTAGES, timings):
            # Without old log-probs (so without a KL penalty) the update reports actor/kl itself.
            skipped_old_pass = "old_log_probs" not in batch.batch
            ref_log_probs = (
                batch.pop(batch_keys=["ref_log_probs"]) if "ref_log_probs" in batch.batch and skipped_old_pass else None
            )
            batch, advantage_metrics = compute_advantages(
                batch, group_index, self.config.algorithm, self.kl_controller.value, self._failed_episodes(batch)
            )
            if ref_log_probs is not None:
                batch = batch.union(ref_log_probs)
                advantage_metrics["actor/kl_coef"] = 0.0
            metrics.update(advantage_metrics)
            if "actor/kl" in metrics:
                self.kl_controller.update(metrics["actor/kl"], len(batch))
        return batch

    def update(self, batch: DataProto, metrics: dict[str, float], timings: dict[str, float]) -> None:
        """Filter overlong responses out of the loss (if configured), then train the critic (if any) and
        actor_train for `ppo_epochs` each; actor_infer's weights are then stale."""
        algorithm = self.config.algorithm
        if algorithm.overlong_filter:
            fraction = mask_truncated_responses(batch)
            metrics["actor/overlong_filtered_fraction"] = fraction
        # What the losses read: not the scores, nor the teacher's log-probs (already in the token rewards).
        unread = ("scores", "verifier_scores", "teacher_log_probs")
        images = [k for k in IMAGE_KEYS if k in batch.non_tensor_batch]  # every forward pass of the update reads them
        train_batch = batch.select(batch_keys=[k for k in batch.batch if k not in unread], non_tensor_keys=images)
        for role, phase in reversed(self._trained_roles()):  # the critic's update, then actor_train's
            prefix = "actor" if role == "actor_train" else role
            with self.residency.timed(phase, timings):
                for _ in range(algorithm.ppo_epochs):
                    metrics.update(_prefixed(prefix, self.clusters[role].train_step(train_batch, algorithm)))
        self.versions.updated()  # one policy version per RL step, whatever its epochs
        self.weights_stale = True

    def _overhead(self, step_seconds: float) -> dict[str, float]:
        """Worker compute time of the step (slowest rank of each role) and the rest's share of the step.

        Roles run one after another, so their compute adds up; what remains is dispatch, data
        transport through Ray and the driver's own work.
        """
        futures = [cluster.pop_compute_seconds(blocking=False) for cluster in self.clusters.values()]
        compute = sum(max(future.get()) for future in futures)
        return {"time/worker_compute_s": compute, "time/overhead_fraction": max(0.0, 1 - compute / step_seconds)}

    def _rollout_metrics(self, batch: DataProto) -> dict[str, float]:
        data = batch.batch
        lengths = data["response_mask"].sum(-1).float()
        verdicts = data["scores"] if self.answer_check is None else self.answer_check(batch)
        return {
            "rollout/score_mean": data["scores"].float().mean().item(),
            "rollout/accuracy": (verdicts >= 1).float().mean().item(),
            "rollout/reward_failed": data["reward_failed"].sum().item(),
            "rollout/response_length_mean": lengths.mean().item(),
            "rollout/response_length_max": lengths.max().item(),
        }

    def _log_samples(self, batch: DataProto, step: int) -> None:
        texts, scores = batch.non_tensor_batch, batch.batch["scores"]
        rows = [
            [str(texts["prompt"][i]), str(texts["response_text"][i]), str(texts["answer"][i]), scores[i].item()]
            for i in range(min(self.config.num_log_samples, len(batch)))
        ]
        self.tracker.log_samples(["prompt", "response", "answer", "score"], rows, step)
        for i in range(len(rows)):
            logger.info(
                "step %d sample %d: %r -> %r (answer %r, score %.1f)",
                step,
                i,
                batch.non_tensor_batch["prompt"][i],
                batch.non_tensor_batch["response_text"][i],
                batch.non_tensor_batch["answer"][i],
                batch.batch["scores"][i].item(),
            )

    # ---- evaluation, checkpoints, the loop -------------------------------------------------

    def _episodes(self, seeds: list[int], step: int, round_: int = 0) -> DataProto:
        """Episodes of `seeds` (each played by a group) through actor_infer, sampled with seeds of `step` and the
        dynamic-sampling round; their metrics in `meta_info`."""
        assert self.env_rollouts is not None
        n = self.config.actor_infer.generating_args.num_return_sequences
        base_seed = self.config.seed + step + round_ * (self.config.max_steps + 1)
        batch, episode_metrics = self.env_rollouts.train_batch(self.clusters["actor_infer"], seeds, n, base_seed)
        batch.meta_info[EPISODE_METRICS] = episode_metrics
        return batch

    def play_episodes(self, step: int, metrics: dict[str, float], timings: dict[str, float]) -> DataProto:
        """`step`'s batch of environment episodes (groups share their seed; played during the previous step when
        generation is overlapped), scored by the environment; logs the rollout's metrics and a few episodes."""
        assert self.config.env is not None
        batch = self._rollout(step, metrics, timings)
        metrics.update(batch.meta_info.pop(EPISODE_METRICS))
        metrics.update(self._rollout_metrics(batch))
        self._log_samples(batch, step)
        return self._scored_episodes(batch, metrics)

    def _scored_episodes(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        """Episodes with the trajectory budget as their response length, and the overlong penalty if configured: the
        whole trajectory (actions and observations) counted against that budget."""
        assert self.config.env is not None
        budget = self.config.env.max_trajectory_tokens
        batch.meta_info[MAX_RESPONSE_LENGTH] = budget
        if self.config.algorithm.overlong_buffer_len is not None:
            width = batch.batch["responses"].shape[1]
            lengths = batch.batch["attention_mask"][:, -width:].sum(-1)
            penalty = add_overlong_penalty(batch, budget, self.config.algorithm, lengths)
            metrics["rollout/overlong_penalty_mean"] = penalty
        return batch

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current policy (actor_infer with the latest weights): `val/accuracy`, greedy;
        with an environment, the success rate of greedy episodes on the held-out seeds, and of sampled ones
        (`val/sampled_success`)."""
        if self.in_flight is not None:
            self.in_flight.result()  # the weight sync needs actor_infer idle
        self.sync_weights()
        self.residency.enter(phases.GENERATE)
        if self.env_rollouts is not None:
            return self.env_rollouts.held_out(self.clusters["actor_infer"])
        accuracy, _ = greedy_accuracy(
            self.clusters["actor_infer"],
            self.eval_examples,
            self.pad_id,
            self.config.actor_infer.generating_args,
            self.eval_score,
        )
        return {"val/accuracy": accuracy}

    def _trained_roles(self) -> list[tuple[str, Phase]]:
        """The roles with optimizer state (they checkpoint), each with the phase that makes it resident."""
        trained = [("actor_train", phases.ACTOR_UPDATE), ("critic", phases.CRITIC_UPDATE)]
        return [(role, phase) for role, phase in trained if role in self.clusters]

    def save(self, step: int, history_accuracy: list[float]) -> str:
        """Checkpoint the trained roles and the driver's state at `step`; return the checkpoint path."""
        root, tag = self.config.checkpoint_root, f"step_{step}"
        for role, phase in self._trained_roles():
            self.residency.enter(phase)
            self.clusters[role].save_checkpoint(str(root / role), tag)
        state = {
            "step": step,
            "sampler": self.sampler.state_dict(),  # past the prompts of a batch in flight, which is saved beside
            "policy_versions": {"trained": self.versions.trained, "served": self.versions.served},
            IN_FLIGHT: None if self.in_flight is None else save_in_flight(self.in_flight, root / tag),
            "kl_coef": self.kl_controller.value,
            "val_accuracy_history": history_accuracy,
            checkpoint_state.ROLES: [role for role, _ in self._trained_roles()],
        }
        return checkpoint_state.save_driver_state(root, tag, state, self.config.keep_last_n)

    def resume(self) -> dict:
        """Restore roles and driver state from `resume_from_checkpoint`; return the driver state."""
        root = self.config.resume_root
        state = checkpoint_state.load_driver_state(root, self.config.resume_tag)
        tag = f"step_{state['step']}"
        for role, phase in self._trained_roles():
            self.residency.enter(phase)
            self.clusters[role].load_checkpoint(str(root / role), tag)
        self.sampler.load_state_dict(state["sampler"])
        self.kl_controller.value = state["kl_coef"]
        self.weights_stale = True
        self.restore_schedule(root / tag, state)
        return state

    def restore_schedule(self, directory: Path, state: dict) -> None:
        """The policy versions and the batch in flight (overlapped generation) of checkpoint `directory`'s state;
        a checkpoint from before they were saved resumes with a fresh count and generates its next batch anew."""
        versions = state.get("policy_versions", {"trained": 0, "served": 0})
        self.versions.trained, self.versions.served = versions["trained"], versions["served"]
        if state.get(IN_FLIGHT):
            self.in_flight = load_in_flight(directory, state[IN_FLIGHT])

    def shutdown(self, close_timeout_s: float = 60) -> None:
        """Close the environments (with `env` set), then stop every role."""
        if self.env_rollouts is not None:
            self.env_rollouts.close()
        super().shutdown(close_timeout_s)

    def run(self) -> dict[str, float]:
        """Train for `max_steps`, checkpoint, export the policy; print and return held-out accuracy before and after."""
        config = self.config
        start_step, accuracies = 0, []
        if config.resume_from_checkpoint:
            state = self.resume()
            start_step, accuracies = state["step"], state["val_accuracy_history"]
        self.tracker = tracker = MetricsTracker.for_run(config, start_step)
        if not start_step:
            evaluation = timed_evaluation(self.evaluate, 0)
            accuracies.append(evaluation["val/accuracy"])
            tracker.log(evaluation, 0)
        progress = show_progress(range(start_step + 1, config.max_steps + 1), desc="rlvr")
        for step in progress:
            started = time.perf_counter()
            metrics = self.step(step)
            if step % config.eval_steps == 0 or step == config.max_steps:
                evaluation = timed_evaluation(self.evaluate, step)
                accuracies.append(evaluation["val/accuracy"])
                metrics.update(evaluation)
            metrics["time/step_s"] = time.perf_counter() - started
            metrics.update(self.fault_metrics)
            if not config.async_generation_ratio:
                # Overlapped roles do not add up, and asking actor_infer would wait for its batch in flight.
                metrics.update(self._overhead(metrics["time/step_s"]))
            tracker.log(metrics, step)
            progress.set_postfix(
                step_s=f"{metrics['time/step_s']:.1f}",
                reward=f"{metrics.get('rollout/score_mean', float('nan')):.2f}",
                val_acc=f"{accuracies[-1]:.2f}",
            )
            saved = None
            if config.save_steps and step % config.save_steps == 0 and step != config.max_steps:
                saved = self.save(step, accuracies)
            if self.stop_requested and step != config.max_steps:
                raise Preempted(step, saved or self.save(step, accuracies))
        self.save(config.max_steps, accuracies)
        self.residency.enter(phases.ACTOR_UPDATE)
        # Agents trained through the endpoint: the export renders their prompts as the endpoint did.
        template = export_chat_template(config.env)
        export_dir = self.clusters["actor_train"].export_hf(config.model_export_dir, template)[0]
        plots = tracker.close()
        summary = {"val_accuracy_before": accuracies[0], "val_accuracy_after": accuracies[-1]}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"logs, TensorBoard events and plots ({len(plots)} PNG) in {tracker.log_dir}", flush=True)
        print(f"policy exported to {export_dir}", flush=True)
        print(f"val accuracy {accuracies[0]:.2f} -> {accuracies[-1]:.2f}", flush=True)
        return summary


def _prefixed(prefix: str, per_rank: list[dict[str, float]]) -> dict[str, float]:
    # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
    return {f"{prefix}/{k}": v for k, v in per_rank[0].items()}
