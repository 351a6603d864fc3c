"""The multi-turn rollout: episodes of an environment played by actor_infer, as one batch in the single-turn layout.

Token in, token out. Each turn generates for every running episode from its token history (left-padded),
keeps the sampled ids exactly as the engine returned them (the final EOS included), decodes them for the
environment, and appends the observation encoded on its own (`observations`; with a chat template the first
one lists the environment's tools, its `tool_schemas()`). The batch it returns is what the rest of the RLVR step
reads from a single-turn rollout:

- `prompts`: the first observation (left-padded); `responses`: everything after it, actions and observations,
  right-padded to `env.max_trajectory_tokens`;
- `response_mask`: the loss mask, 1 exactly on sampled tokens; `attention_mask`: 1 on every real token;
- `scores` (sum or last of the turn rewards), `turn_rewards` (each turn's reward on its last sampled token),
  `turn_discounts` (`env.turn_gamma` on each turn's last sampled token, 1 elsewhere: the discount to the next turn),
  `truncated`, `reward_failed` (1 for an episode an environment error ended: it is not trained), and
  `engine_log_probs` (0 on environment tokens) when asked for.

An observation may show images (a vision-language policy, its `processor`): its image tokens are appended with
its other tokens (no loss on them either), and the episode's images, in the order they came, travel with the row
(`roll.models.vision_inputs`) into every generation and every pass over the batch.

The environments run in the driver (`EnvManager`, threads with a timeout) or, with `env.num_env_workers`, in
CPU Ray actors (`EnvWorkers`, the env role), which answer the same calls. With `env.sources` each episode plays
the source its seed draws: every source has its own environments and prompt tools, one generation serves all
episodes of a turn, and the metrics come overall and per source (`rollout/<source>/...`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from transformers import ProcessorMixin

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.envs.manager import EnvManager, EnvResult
from roll.envs.protocol import (
    ENV_ERROR,
    ENV_ERROR_MESSAGE,
    INVALID_ACTION,
    OBSERVATION_ROLE,
    SUCCESS,
    TOOL_CALLS,
    TOOL_SUCCESSES,
    observation_text,
)
from roll.models.vision_inputs import image_columns
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.env_workers import EnvWorkers
from roll.pipeline.agentic.generation_queue import Generate, left_padded, sampled_rows
from roll.pipeline.agentic.observations import EncodedObservation, ObservationEncoder
from roll.pipeline.agentic.sources import group_by_source, per_source_metrics

# Turn seeds of one rollout are base_seed * TURN_SEED_STRIDE + turn, so no two turns or steps share one.
TURN_SEED_STRIDE = 1000
# Episodes of each batch whose ids are checked against the chat template's rendering (`rollout/template_drift`).
DRIFT_CHECKED_EPISODES = 8


@dataclass
class Episode:
    """One trajectory as it is played: the ids, the loss mask and what each turn returned."""

    seed: int
    source: str = ""  # the name of the episode's source (env.sources), or env.name
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    # (index in response_ids of the turn's last sampled token, the turn's reward)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)  # each transcript entry's chat role
    prompt_cut: bool = False  # the first observation was cut to env.max_observation_tokens
    prompt: str = ""
    done: bool = False
    truncated: bool = False
    success: float = 0.0
    counts: dict[str, float] = field(default_factory=dict)
    error: str = ""  # the environment's error that ended the episode (its `env_error_message`)
    # The images its observations showed, in order: each observation's pixel values and image grid.
    pixel_values: list[np.ndarray] = field(default_factory=list)
    image_grids: list[np.ndarray] = field(default_factory=list)

    def add_images(self, encoded: EncodedObservation) -> None:
        """Keep an observation's images (none for text)."""
        if encoded.pixel_values is not None and len(encoded.image_grid_thw):
            self.pixel_values.append(encoded.pixel_values)
            self.image_grids.append(encoded.image_grid_thw)

    def images(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """All its images' pixel values and grids, concatenated in order; (None, None) without images."""
        if not self.image_grids:
            return None, None
        return np.concatenate(self.pixel_values), np.concatenate(self.image_grids)

    def count(self, info: dict[str, Any]) -> None:
        """Add a turn's numeric info to the episode's counts."""
        for key in (INVALID_ACTION, TOOL_CALLS, TOOL_SUCCESSES, ENV_ERROR):
            value = info.get(key)
            if isinstance(value, (bool, int, float)):
                self.counts[key] = self.counts.get(key, 0.0) + float(value)
        if isinstance(info.get(SUCCESS), (bool, int, float)):
            self.success = float(info[SUCCESS])
        if info.get(ENV_ERROR) and not self.error:
            self.error = str(info.get(ENV_ERROR_MESSAGE, "environment error"))

    def end(self, truncated: bool = False) -> None:
        """Stop playing this episode."""
        self.done = True
        self.truncated = self.truncated or truncated


class MultiTurnRollout:
    """Plays episodes of `env` with a `generate` function; `run` returns the batch and its metrics."""

    def __init__(
        self,
        env: EnvArguments,
        tokenizer: Any,
        pad_id: int,
        with_engine_log_probs: bool = False,
        stop_ids: Sequence[int] = (),
        processor: ProcessorMixin | None = None,
    ) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        # The ids generation stops on (the generation config's EOS list, e.g. Gemma's <end_of_turn>) and the EOS.
        self.stop_ids = {*stop_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
        self.with_engine_log_probs = with_engine_log_probs
        self.blocks = env.source_envs()
        # Each source's tools, listed in the prompt by the chat template (without one, the observations say it).
        self.encoders = {
            name: ObservationEncoder(
                tokenizer, env.apply_chat_template, block.tool_schemas() if env.apply_chat_template else [], processor
            )
            for name, block in self.blocks.items()
        }
        self._managers: dict[tuple[str, int], EnvManager | EnvWorkers] = {}

    def _manager(self, source: str, num_envs: int) -> EnvManager | EnvWorkers:
        """The environments of `source` for a batch of `num_envs` episodes: built on first use, kept for the next
        batches (each episode resets its slot; a slot whose environment failed is rebuilt)."""
        manager = self._managers.get((source, num_envs))
        if manager is None:
            env = self.blocks[source]
            if env.num_env_workers:
                manager = EnvWorkers(env, num_envs)
            else:
                manager = EnvManager(env.make_env, num_envs, env.max_concurrency, env.timeout_s)
            self._managers[(source, num_envs)] = manager
        return manager

    def close(self) -> None:
        """Close every environment this rollout built."""
        for manager in self._managers.values():
            manager.close()
        self._managers.clear()

    def run(
        self, generate: Generate, seeds: Sequence[int], generating_args: GeneratingArguments, base_seed: int
    ) -> tuple[DataProto, dict[str, float]]:
        """Play one episode per seed (repeat a seed for a GRPO group); return the batch and the rollout metrics."""
        env = self.env
        names = env.source_names(list(seeds))
        episodes = [Episode(seed, name) for seed, name in zip(seeds, names, strict=True)]
        slots = _source_slots(names, len(seeds))
        for i, result in zip(*self._call("reset", list(seeds), range(len(seeds)), names, slots), strict=True):
            self._start(episodes[i], result)
        for turn in range(env.max_turns):
            active = [i for i, episode in enumerate(episodes) if not episode.done]
            if not active:
                break
            turn_args = replace(generating_args, num_return_sequences=1, seed=base_seed * TURN_SEED_STRIDE + turn)
            actions = self._act([episodes[i] for i in active], generate, turn_args)
            for i, result in zip(*self._call("step", actions, active, names, slots), strict=True):
                self._observe(episodes[i], result, last_turn=turn + 1 == env.max_turns, turn_args=turn_args)
        metrics = episode_metrics(episodes)
        if env.sources:
            metrics |= per_source_metrics(episodes, names, episode_metrics)
        # Episodes with images are not re-rendered: their ids come from the processor, not the tokenizer alone.
        checked = [e for e in episodes if not e.prompt_cut and not e.image_grids][:DRIFT_CHECKED_EPISODES]
        if env.apply_chat_template and checked:
            metrics["rollout/template_drift"] = self._template_drift(checked)
        return self._batch(episodes), metrics

    def _call(
        self, method: str, items: list[Any], positions: Sequence[int], names: list[str], slots: list[int]
    ) -> tuple[list[int], list[EnvResult]]:
        """`reset` or `step` the episodes at `positions` with `items`, each through its source's manager and slot;
        the positions and results in the order answered."""
        num_envs = len(names)
        answered: list[int] = []
        results: list[EnvResult] = []
        by_source = group_by_source([names[p] for p in positions])
        for source, indices in by_source.items():
            chosen = [positions[k] for k in indices]
            manager = self._manager(source, num_envs)
            results += getattr(manager, method)([items[k] for k in indices], [slots[p] for p in chosen])
            answered += chosen
        return answered, results

    def _template_drift(self, episodes: list[Episode]) -> float:
        """The share of `episodes` whose ids differ from their conversation rendered by the chat template anew.

        Token in, token out trains on the ids as sampled and appended. A model served by re-rendering the
        conversation each turn (a chat API) would see the template's ids instead: where they differ (an action
        sampled as a non-canonical tokenisation, a special token inside one, a template that rewrites earlier
        turns), training and serving see different inputs.
        """
        drifted = 0
        for episode in episodes:
            messages = [{"role": "user", "content": episode.prompt}]
            messages += [{"role": r, "content": t} for r, t in zip(episode.roles, episode.transcript, strict=True)]
            rendered = self.encoders[episode.source].render(messages)
            rendered_ids = list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
            played = episode.prompt_ids + episode.response_ids
            drifted += rendered_ids[: len(played)] != played
        return drifted / len(episodes)

    def _start(self, episode: Episode, result: EnvResult) -> None:
        episode.prompt = observation_text(result.observation)
        encoded = self.encoders[episode.source].encode_first(result.observation) if not result.done else None
        ids = encoded.ids if encoded is not None else []
        if len(ids) > self.env.max_observation_tokens and encoded.pixel_values is not None:
            # An image's tokens cannot be cut: the episode ends before its first turn.
            ids, episode.prompt_cut, encoded = [], True, None
            episode.end(truncated=True)
        elif len(ids) > self.env.max_observation_tokens:
            # Cut, and the episode still plays: the loss of a truncated row is only dropped by overlong_filter.
            ids, episode.truncated, episode.prompt_cut = ids[-self.env.max_observation_tokens :], True, True
        episode.prompt_ids = ids or [self.pad_id]
        if encoded is not None:
            episode.add_images(encoded)
        episode.count(result.info)
        if result.done:
            episode.end(truncated=True)

    def _act(self, episodes: list[Episode], generate: Generate, args: GeneratingArguments) -> list[str]:
        """Generate one turn for `episodes`, append the sampled ids to each, return the decoded actions."""
        histories = [episode.prompt_ids + episode.response_ids for episode in episodes]
        request = with_episode_images(left_padded(histories, self.pad_id, self.with_engine_log_probs), episodes)
        out = generate(request, args)
        actions = []
        for episode, (sampled, log_probs) in zip(episodes, sampled_rows(out, self.with_engine_log_probs), strict=True):
            episode.response_ids += sampled
            episode.loss_mask += [1] * len(sampled)
            episode.log_probs += log_probs
            action = self.tokenizer.decode(sampled, skip_special_tokens=True)
            episode.transcript.append(action)
            episode.roles.append("assistant")
            actions.append(action)
        return actions

    def _observe(self, episode: Episode, result: EnvResult, last_turn: bool, turn_args: GeneratingArguments) -> None:
        """Record a step's reward on the turn's last sampled token; append its observation if another turn fits."""
        episode.turn_rewards.append((max(len(episode.response_ids) - 1, 0), result.reward))
        episode.count(result.info)
        if result.done:
            episode.end(truncated=result.truncated)
            return
        if last_turn:
            episode.end(truncated=True)
            return
        last = episode.response_ids[-1] if episode.response_ids else None
        action_end = self.tokenizer.decode([last]) if last in self.stop_ids else ""  # "": cut at max_new_tokens
        role = "tool" if result.info.get(OBSERVATION_ROLE) == "tool" else "user"
        encoded = self.encoders[episode.source].encode_next(result.observation, role, action_end)
        ids = encoded.ids
        budget = self.env.max_trajectory_tokens - len(episode.response_ids) - turn_args.max_new_tokens
        if len(ids) > self.env.max_observation_tokens or len(ids) > budget:
            episode.end(truncated=True)  # the observation is cut to nothing: no action would follow it
            return
        episode.response_ids += ids
        episode.loss_mask += [0] * len(ids)
        episode.add_images(encoded)
        episode.log_probs += [0.0] * len(ids) if self.with_engine_log_probs else []
        episode.transcript.append(observation_text(result.observation))
        episode.roles.append(role)

    def _batch(self, episodes: list[Episode]) -> DataProto:
        """The episodes in the single-turn rollout layout (see the module docstring)."""
        return episodes_batch(episodes, self.env, self.pad_id, self.with_engine_log_probs)


def _source_slots(names: list[str], num_envs: int) -> list[int]:
    """Each episode's slot in its source's manager of `num_envs` slots: a source's k episodes spread evenly over
    the slots, so that env workers (which hold contiguous blocks of slots) share them."""
    slots = [0] * len(names)
    for positions in group_by_source(names).values():
        for k, position in enumerate(positions):
            slots[position] = k * num_envs // len(positions)
    return slots


def with_episode_images(batch: DataProto, episodes: Sequence[Episode]) -> DataProto:
    """`batch` (one row per episode) with the episodes' image columns when any has images; else `batch`."""
    if not any(episode.image_grids for episode in episodes):
        return batch
    pixels, grids = zip(*(episode.images() for episode in episodes), strict=True)
    images = image_columns(list(pixels), list(grids))
    return DataProto(batch.batch, {**batch.non_tensor_batch, **images}, batch.meta_info)  # lists: one object a row


def episodes_batch(episodes: list[Episode], env: EnvArguments, pad_id: int, with_engine_log_probs: bool) -> DataProto:
    """`episodes` in the single-turn rollout layout (see the module docstring)."""
    rows, width = len(episodes), env.max_trajectory_tokens
    prompt_width = max(len(e.prompt_ids) for e in episodes)
    prompts = torch.full((rows, prompt_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
    responses = torch.full((rows, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.long)
    attended = torch.zeros((rows, width), dtype=torch.long)
    turn_rewards = torch.zeros((rows, width), dtype=torch.float32)
    turn_discounts = torch.ones((rows, width), dtype=torch.float32)
    log_probs = torch.zeros((rows, width), dtype=torch.float32)
    scores = torch.zeros(rows, dtype=torch.float32)
    for i, e in enumerate(episodes):
        p, r = len(e.prompt_ids), len(e.response_ids)
        prompts[i, prompt_width - p :] = torch.tensor(e.prompt_ids)
        prompt_mask[i, prompt_width - p :] = 1
        if r:
            responses[i, :r] = torch.tensor(e.response_ids)
            response_mask[i, :r] = torch.tensor(e.loss_mask)
            attended[i, :r] = 1
        if with_engine_log_probs and r:
            log_probs[i, :r] = torch.tensor(e.log_probs)
        for position, reward in e.turn_rewards:
            turn_rewards[i, position] += reward
            turn_discounts[i, position] = env.turn_gamma
        rewards = [reward for _, reward in e.turn_rewards]
        scores[i] = (sum(rewards) if env.trajectory_score == "sum" else rewards[-1]) if rewards else 0.0
    input_ids, attention_mask = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, attended], 1)
    sequences = {"input_ids": input_ids, "attention_mask": attention_mask}
    tensors = {"prompts": prompts, "responses": responses, "response_mask": response_mask, **sequences}
    tensors["truncated"] = torch.tensor([e.truncated for e in episodes])
    tensors |= {"scores": scores, "turn_rewards": turn_rewards, "turn_discounts": turn_discounts}
    # An episode whose environment raised, hung or returned garbage has no real reward: the pipeline leaves it
    # out of its group's statistics and of the loss (`compute_advantages(excluded=...)`).
    tensors["reward_failed"] = torch.tensor([float(e.counts.get(ENV_ERROR, 0.0) > 0) for e in episodes])
    if with_engine_log_probs:
        tensors["engine_log_probs"] = log_probs
    non_tensors = {
        "prompt": [e.prompt for e in episodes],
        "response_text": [" | ".join(e.transcript) for e in episodes],
        "answer": [f"seed {e.seed}, success {e.success:g}" for e in episodes],
        "env_seed": np.array([e.seed for e in episodes], dtype=np.int64),
        "env_error": [e.error for e in episodes],
        "env_source": [e.source for e in episodes],
    }
    return with_episode_images(DataProto.from_dict(tensors=tensors, non_tensors=non_tensors), episodes)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Success, turns, invalid actions, tool use, truncations and environment errors of the episodes."""
    count = len(episodes)
    turns = [len(e.turn_rewards) for e in episodes]
    total = {key: sum(e.counts.get(key, 0.0) for e in episodes) for key in (INVALID_ACTION, TOOL_CALLS, ENV_ERROR)}
    tool_successes = sum(e.counts.get(TOOL_SUCCESSES, 0.0) for e in episodes)
    return {
        "rollout/success": sum(e.success for e in episodes) / count,
        "rollout/turns_mean": sum(turns) / count,
        "rollout/invalid_action_rate": total[INVALID_ACTION] / max(sum(turns), 1),
        "rollout/tool_calls_per_episode": total[TOOL_CALLS] / count,
        "rollout/tool_success_rate": tool_successes / total[TOOL_CALLS] if total[TOOL_CALLS] else 0.0,
        "rollout/truncated_fraction": sum(e.truncated for e in episodes) / count,
        "rollout/env_errors": total[ENV_ERROR],
    }
