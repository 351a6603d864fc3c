"""A run of `env.sources` some of which name an agent (`env.sources[i].agent`): each episode is played as its source
says, by the policy in the environment (`MultiTurnRollout`) or by the source's agent through the endpoint
(`AgentRollout`), and the parts come back as one batch in the episodes' order, with metrics overall and per source.

The episodes of environment sources are played first (one generation per turn serves all of them), then each agent
source's (one wave of its agents' calls at a time). The overall metrics are those of all episodes: each rate
weighted by what it is a rate of (episodes, turns, tool calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from roll.algorithms.episode_rows import EPISODE_INDEX
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.agentic.agent_rollout import AgentRollout
from roll.pipeline.agentic.agent_workers import AgentWorkers
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.chat_server import ChatServer
from roll.pipeline.agentic.generation_queue import Generate
from roll.pipeline.agentic.multi_turn import MultiTurnRollout
from roll.pipeline.agentic.sources import group_by_source
from roll.pipeline.base.rollout_batches import concat_rollouts

# Overall metrics that are means over episodes, and counts (summed over the parts).
EPISODE_MEANS = (
    "rollout/success",
    "rollout/turns_mean",
    "rollout/truncated_fraction",
    "rollout/tool_calls_per_episode",
)
COUNTS = (
    "rollout/env_errors",
    "rollout/agent_new_segments",
    "rollout/agent_rejected_calls",
    "rollout/agent_timeouts",
    "rollout/agent_errors",
    "rollout/agent_rows",
)


class MixedRollout:
    """Episodes of `env.sources`, each played by its source's agent or by the policy in its environment."""

    def __init__(
        self,
        env: EnvArguments,
        tokenizer: Any,
        pad_id: int,
        server: ChatServer,
        with_engine_log_probs: bool = False,
        stop_ids: Sequence[int] = (),
        agent_workers: dict[str, AgentWorkers] | None = None,
    ) -> None:
        self.env = env
        self.pad_id = pad_id
        blocks = env.source_envs()
        # All sources stay in the environments' block, so the draw of each seed's source is the run's.
        self.environments = MultiTurnRollout(env, tokenizer, pad_id, with_engine_log_probs, stop_ids)
        self.agents = {
            name: AgentRollout(
                block,
                tokenizer,
                pad_id,
                server,
                with_engine_log_probs,
                stop_ids,
                source=name,
                workers=(agent_workers or {}).get(name),
            )
            for name, block in blocks.items()
            if block.agent is not None
        }

    def run(
        self, generate: Generate, seeds: Sequence[int], generating_args: GeneratingArguments, base_seed: int
    ) -> tuple[DataProto, dict[str, float]]:
        """Play one episode per seed (repeat a seed for a GRPO group); return the batch in the seeds' order, each
        row's `episode_index` its episode's position in `seeds`, and the rollout metrics."""
        by_source = group_by_source(self.env.source_names(list(seeds)))
        parts: list[tuple[DataProto, dict[str, float], list[int]]] = []
        played = [p for name, positions in by_source.items() if name not in self.agents for p in positions]
        if played:
            batch, metrics = self.environments.run(generate, [seeds[p] for p in played], generating_args, base_seed)
            batch.batch[EPISODE_INDEX] = torch.arange(len(batch))
            parts.append((batch, metrics, played))
        for name, positions in by_source.items():
            if name in self.agents:
                batch, metrics = self.agents[name].run(
                    generate, [seeds[p] for p in positions], generating_args, base_seed
                )
                parts.append((batch, metrics | _prefixed(metrics, name), positions))
        for batch, _, positions in parts:  # each part's episodes numbered by their place in `seeds`
            batch.batch[EPISODE_INDEX] = torch.tensor(positions)[batch.batch[EPISODE_INDEX]]
        joined = concat_rollouts([batch for batch, _, _ in parts], self.pad_id)
        order = torch.argsort(joined.batch[EPISODE_INDEX], stable=True)
        return joined[order], combined_metrics([(metrics, len(positions)) for _, metrics, positions in parts])

    def close(self) -> None:
        """Close the environments of the environment sources, and the agents' env workers (their tasks close with
        their episodes)."""
        self.environments.close()
        for agent in self.agents.values():
            agent.close()


def _prefixed(metrics: dict[str, float], source: str) -> dict[str, float]:
    """An agent source's metrics as that source's: `rollout/<source>/...`."""
    return {key.replace("rollout/", f"rollout/{source}/", 1): value for key, value in metrics.items()}


def combined_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of several parts of one batch (each its metrics and episodes): per-source keys as they are, and
    the overall ones of all episodes together (counts summed, rates weighted by their episodes, turns or tool
    calls, the agents' calls per episode by their episodes, the template drift by the environment part's)."""
    merged = {k: v for metrics, _ in parts for k, v in metrics.items() if k.count("/") > 1}
    episodes = sum(count for _, count in parts)
    for key in EPISODE_MEANS:
        merged[key] = sum(metrics[key] * count for metrics, count in parts) / episodes
    for key in COUNTS:
        if any(key in metrics for metrics, _ in parts):
            merged[key] = sum(metrics.get(key, 0.0) for metrics, _ in parts)
    turns = [(metrics["rollout/turns_mean"] * count, metrics) for metrics, count in parts]
    merged["rollout/invalid_action_rate"] = _weighted(
        [(w, m["rollout/invalid_action_rate"]) for w, m in turns if "rollout/invalid_action_rate" in m]
    )
    calls = [(m["rollout/tool_calls_per_episode"] * c, m) for m, c in parts if "rollout/tool_success_rate" in m]
    merged["rollout/tool_success_rate"] = _weighted([(w, m["rollout/tool_success_rate"]) for w, m in calls])
    agent_parts = [(count, m["rollout/agent_calls_per_episode"]) for m, count in parts if "rollout/agent_rows" in m]
    if agent_parts:
        merged["rollout/agent_calls_per_episode"] = _weighted(agent_parts)
    for metrics, _ in parts:
        if "rollout/template_drift" in metrics:
            merged["rollout/template_drift"] = metrics["rollout/template_drift"]
    return merged


def _weighted(pairs: list[tuple[float, float]]) -> float:
    """The mean of the values weighted by their weights; 0 without weight."""
    total = sum(weight for weight, _ in pairs)
    return sum(weight * value for weight, value in pairs) / total if total else 0.0
