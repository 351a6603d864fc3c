"""The RLVR step's rollout when the config has an `env`: seeds, episodes through actor_infer, held-out success.

It stands in for the prompt sampler and the reward clusters: `EpisodeSeeds` is the sampler (its position is
checkpointed like one), `EnvRollouts.train_batch` the generated and scored batch of a step, and
`EnvRollouts.held_out` the evaluation on held-out seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from roll.configs.data_config import DataArguments
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto
from roll.models.processors import processor_for
from roll.pipeline.agentic.agent_rollout import AgentRollout
from roll.pipeline.agentic.agent_tasks import task_maker
from roll.pipeline.agentic.agent_workers import agent_workers_of, endpoint_host
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.chat_server import ChatServer
from roll.pipeline.agentic.mixed_rollout import MixedRollout
from roll.pipeline.agentic.multi_turn import MultiTurnRollout
from roll.pipeline.agentic.sources import group_by_source

# Training batches in a row whose every episode (of one source, with env.sources) an environment error ended: then
# the run stops, naming the error.
ALL_FAILED_BATCHES_LIMIT = 3


class EpisodeSeeds:
    """Training seeds 0, 1, 2, ... `batch_size` at a time; its position is part of a checkpoint."""

    def __init__(self, batch_size: int, limit: int) -> None:
        self.batch_size = batch_size
        self.limit = limit  # the first held-out seed: training never reaches it
        self.position = 0

    def next_batch(self) -> list[int]:
        """The next `batch_size` seeds."""
        if self.position + self.batch_size > self.limit:
            raise RuntimeError(f"training seeds reached the held-out seeds at {self.limit}; raise env.eval_seed_offset")
        seeds = list(range(self.position, self.position + self.batch_size))
        self.position += self.batch_size
        return seeds

    def state_dict(self) -> dict[str, int]:
        """The position, for a checkpoint."""
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a checkpoint's position."""
        self.position = int(state["position"])


def cluster_generate(cluster: Cluster) -> Any:
    """`generate(request, args)` on `cluster`, the request padded to its data-parallel size and back."""

    def generate(request: DataProto, args: GeneratingArguments) -> DataProto:
        padded, pad = request.pad_to_divisor(cluster.world_size)
        return cluster.generate(padded, args).unpad(pad)

    return generate


class EnvRollouts:
    """Episodes of `env` played by an actor_infer cluster, for training steps and held-out evaluation."""

    def __init__(
        self,
        env: EnvArguments,
        tokenizer: Any,
        pad_id: int,
        generating_args: GeneratingArguments,
        with_engine_log_probs: bool,
        stop_ids: Sequence[int] = (),
        data: DataArguments | None = None,
    ) -> None:
        self.env = env
        self.generating_args = generating_args
        # stop_ids: the ids generation stops on (the policy's generation config's EOS list), ending a turn.
        # With env.agent, the user's agent plays the episodes through the endpoint both rollouts share, its tasks
        # an environment's or (env.agent_task=data) the rows of `data`.
        self.server = ChatServer(endpoint_host(env)) if env.has_agents() else None
        self.agent_tasks = task_maker(env, data) if env.agent else None
        # With env workers, each agent's actors, shared by the training and the held-out rollouts (by source name).
        self.agent_workers = agent_workers_of(env)
        self.rollout = self._rollout(tokenizer, pad_id, with_engine_log_probs, stop_ids)
        self.greedy_rollout = self._rollout(tokenizer, pad_id, False, stop_ids)
        self.all_failed_batches: dict[str, int] = {}  # by source: training batches in a row whose every episode failed

    def _rollout(
        self, tokenizer: Any, pad_id: int, with_engine_log_probs: bool, stop_ids: Sequence[int]
    ) -> MultiTurnRollout | AgentRollout | MixedRollout:
        if self.server is not None and self.env.sources:  # some sources played by agents
            return MixedRollout(
                self.env, tokenizer, pad_id, self.server, with_engine_log_probs, stop_ids, self.agent_workers
            )
        if self.server is not None:
            return AgentRollout(
                self.env,
                tokenizer,
                pad_id,
                self.server,
                with_engine_log_probs,
                stop_ids,
                self.agent_tasks,
                workers=self.agent_workers.get(""),
            )
        # A vision-language policy's processor encodes observations that show images (its tokenizer's directory).
        processor = processor_for(tokenizer.name_or_path)
        return MultiTurnRollout(self.env, tokenizer, pad_id, with_engine_log_probs, stop_ids, processor)

    def train_batch(
        self, cluster: Cluster, seeds: list[int], group_size: int, base_seed: int
    ) -> tuple[DataProto, dict[str, float]]:
        """One episode per seed and group member (members adjacent, sharing their seed), and the metrics.

        RuntimeError naming the environment's error when every episode of `ALL_FAILED_BATCHES_LIMIT` batches in a
        row failed, or with `env.sources` every episode of one source in the batches that drew it: the run would train
        on nothing of it."""
        repeated = [seed for seed in seeds for _ in range(group_size)]
        batch, metrics = self.rollout.run(cluster_generate(cluster), repeated, self.generating_args, base_seed)
        self._check_not_all_failed(batch)
        return batch, metrics

    def _check_not_all_failed(self, batch: DataProto) -> None:
        """Count, per source, the training batches in a row whose every episode of that source failed."""
        failed = batch.batch["reward_failed"].bool().tolist()
        errors = batch.non_tensor_batch["env_error"]
        for source, positions in group_by_source(list(batch.non_tensor_batch["env_source"])).items():
            in_a_row = self.all_failed_batches.get(source, 0) + 1 if all(failed[p] for p in positions) else 0
            self.all_failed_batches[source] = in_a_row
            if in_a_row >= ALL_FAILED_BATCHES_LIMIT:
                error = next((errors[p] for p in positions if errors[p]), "?")
                raise RuntimeError(
                    f"every episode of the last {in_a_row} training batches failed in "
                    f"{_environment(self.env, source)}, so the run would train on nothing of it; "
                    f"the first episode's error: {error}"
                )

    def held_out(self, cluster: Cluster) -> dict[str, float]:
        """Success over the `eval_episodes` held-out seeds: greedy (`val/accuracy`), and sampled as in training,
        one episode per seed with the same sampling seeds at every evaluation (`val/sampled_success`); with
        `env.sources` also each source's over its held-out seeds (`val/<source>/accuracy`, `.../sampled_success`)."""
        seeds = self.env.eval_seeds()
        generate = cluster_generate(cluster)
        greedy_args = replace(self.generating_args, do_sample=False)
        _, greedy = self.greedy_rollout.run(generate, seeds, greedy_args, base_seed=0)
        _, sampled = self.rollout.run(generate, seeds, self.generating_args, base_seed=0)
        return held_out_metrics(greedy, sampled, [source.name for source in self.env.sources])

    def close(self) -> None:
        """Close the environments of both rollouts, and the agents' endpoint."""
        if self.server is not None:
            self.server.close()
        for rollout in (self.rollout, self.greedy_rollout):
            rollout.close()


def held_out_metrics(greedy: dict[str, float], sampled: dict[str, float], sources: list[str]) -> dict[str, float]:
    """The `val/` metrics of the greedy and sampled held-out rollouts' metrics, overall and for each of `sources`
    (a source the held-out seeds did not draw has none)."""
    metrics = {"val/accuracy": greedy["rollout/success"], "val/sampled_success": sampled["rollout/success"]}
    for source in sources:
        key = f"rollout/{source}/success"
        if key in greedy:
            metrics[f"val/{source}/accuracy"] = greedy[key]
            metrics[f"val/{source}/sampled_success"] = sampled[key]
    return metrics


def _environment(env: EnvArguments, source: str) -> str:
    """The environment (or agent) of `source` as the config names it, for an error."""
    for i, s in enumerate(env.sources):
        if s.name == source:
            played = f", played by the agent {s.agent}" if s.agent else ""
            return f"the environment env.sources[{i}] {s.name} ({s.env} with kwargs {s.kwargs}{played})"
    if env.agent_task == "data":
        return f"the agent env.agent={env.agent} on the data rows"
    played = f", played by the agent env.agent={env.agent}" if env.agent else ""
    return f"the environment env.name={env.name} (env.kwargs={env.kwargs}{played})"
