"""Episodes played by a user's agent (`env.agent`) through the OpenAI-compatible endpoint, as one rollout batch.

Each episode: its task is an environment of `env.name` reset with the episode's seed, or a row of the data
(`agent_tasks`); the agent runs in a thread of the driver, or with `env.num_env_workers` in an env-worker actor
(`agent_workers`), with a client whose `base_url` names the episode's session, and returns its reward or a final
answer the task scores (the environment's `step`, or `env.reward_fn`).
Meanwhile the calling thread generates the agents' calls in waves (`GenerationQueue`). An agent that raises,
returns garbage, makes no call or is still running after `env.agent_timeout_s` ends only its own episode: it is
marked `reward_failed`, so its group's statistics and the loss leave it out, and its later calls get unknown-session
errors.

An episode trains one row per segment (`AgentSession.trajectories`): the ids the engine was given and sampled, call
after call, until a call rewrote the history and started the next segment (`rollout/agent_new_segments`). Each row
has the episode's reward on its last sampled token, and the batch's `episode_index` names each row's episode, so
the step takes one score per episode in its group statistics (`roll.algorithms.episode_rows`). A failed episode
has one row, left out of them.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

import torch
from transformers import PreTrainedTokenizerBase

from roll.algorithms.episode_rows import EPISODE_INDEX
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.envs.deadline import Outcome, run_with_deadline
from roll.envs.protocol import ENV_ERROR, TOOL_CALLS
from roll.pipeline.agentic.agent_runner import load_agent, play_episode
from roll.pipeline.agentic.agent_session import AgentSession, Segment, SessionLimits
from roll.pipeline.agentic.agent_tasks import AgentTask, DataRow, DataTask, task_maker
from roll.pipeline.agentic.agent_workers import AgentWorkers
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.chat_server import ChatServer
from roll.pipeline.agentic.generation_queue import Generate, GenerationQueue
from roll.pipeline.agentic.multi_turn import TURN_SEED_STRIDE, Episode, episode_metrics, episodes_batch
from roll.utils.imports import exception_line

logger = logging.getLogger(__name__)


class AgentRollout:
    """Plays episodes of `env.agent` against actor_infer through `server`; `run` returns the batch and metrics."""

    def __init__(
        self,
        env: EnvArguments,
        tokenizer: PreTrainedTokenizerBase,
        pad_id: int,
        server: ChatServer,
        with_engine_log_probs: bool = False,
        stop_ids: Sequence[int] = (),
        tasks: Callable[[int], AgentTask] | None = None,
        source: str = "",
        workers: AgentWorkers | None = None,
    ) -> None:
        assert env.agent is not None
        self.env = env
        self.source = source  # the name of the env.sources entry it plays, for the metrics and errors
        # Each episode seed's task (`agent_tasks.task_maker`): an environment's reset, or a data row.
        self.tasks = tasks or task_maker(env, None)
        self.agent = load_agent(env.agent)
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.server = server
        self.with_engine_log_probs = with_engine_log_probs
        self.stop_ids = {*stop_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
        self.sessions: list[AgentSession] = []  # the last run's, for its calls and segments
        # With env workers the agents run in their actors (`workers`, shared with the other rollouts of this agent),
        # else in driver threads.
        self.workers = workers or (AgentWorkers(env) if env.num_env_workers else None)

    def run(
        self, generate: Generate, seeds: Sequence[int], generating_args: GeneratingArguments, base_seed: int
    ) -> tuple[DataProto, dict[str, float]]:
        """Play one episode per seed (repeat a seed for a GRPO group); return the batch and the rollout metrics."""
        self.server.start()
        if self.workers is not None:
            self.workers.start()
        queue = GenerationQueue(self.pad_id, self.stop_ids, self.with_engine_log_probs)
        args = _turn_args(generating_args, base_seed)
        self.sessions = [self._session(seed, args) for seed in seeds]
        for session in self.sessions:
            self.server.open(session, queue)
        outcomes: list[Outcome] = []
        plays = [partial(self._play, episode, session) for episode, session in enumerate(self.sessions)]
        # The sessions run_with_deadline starts at once, marked before their threads run: else the first wave could
        # be served before a slower thread marks its session, without waiting for that session's first call.
        for session in self.sessions[: self.env.max_concurrency]:
            session.running = True
        agents = threading.Thread(
            target=lambda: outcomes.extend(
                run_with_deadline(plays, self.env.agent_timeout_s, self.env.max_concurrency, "roll-agent")
            ),
            name="roll-agents",
            daemon=True,
        )
        agents.start()
        try:
            queue.serve(generate, lambda: not agents.is_alive(), lambda: sum(s.running for s in self.sessions))
        finally:
            agents.join()
            for session in self.sessions:
                self.server.close_session(session.session_id)
        if self.workers is not None:
            for episode, outcome in enumerate(outcomes):
                if outcome.timed_out:
                    self.workers.kill_hung(episode)
        played = [self._episode(session, outcome) for session, outcome in zip(self.sessions, outcomes, strict=True)]
        episodes = [episode for episode, _ in played]
        failed = [episode.error for episode in episodes if episode.error]
        if failed:
            logger.warning("%d of %d agent episodes failed; the first: %s", len(failed), len(episodes), failed[0])
        rows = [row for _, segments in played for row in segments]
        metrics = episode_metrics(episodes) | self._agent_metrics(outcomes, len(rows))
        metrics.pop("rollout/tool_success_rate")  # the agent runs its tools: the endpoint cannot tell how they went
        batch = episodes_batch(rows, self.env, self.pad_id, self.with_engine_log_probs)
        batch.batch[EPISODE_INDEX] = torch.tensor([e for e, (_, segments) in enumerate(played) for _ in segments])
        return batch, metrics

    def _session(self, seed: int, args: GeneratingArguments) -> AgentSession:
        env = self.env
        limits = SessionLimits(
            env.max_observation_tokens, env.max_trajectory_tokens, env.max_turns, args.max_new_tokens
        )
        brackets = (env.agent_tool_brackets[0], env.agent_tool_brackets[1]) if env.agent_tool_brackets else None
        session_id = secrets.token_hex(8)
        return AgentSession(
            session_id, seed, self.tokenizer, env.apply_chat_template, self.stop_ids, args, limits, brackets
        )

    def _play(self, episode: int, session: AgentSession) -> tuple[str, float, float]:
        """Episode `episode` of the batch: its task, the agent, the reward; (the task's text, reward, success)."""
        session.running = True
        try:
            url = self.server.base_url(session.session_id)
            if self.workers is not None:
                row = self._data_row(session.seed)
                return self.workers.play(episode, session.seed, row, url, self.server.api_key)
            task = self.tasks(session.seed)
            return play_episode(self.agent, task, url, self.server.api_key, self.env.agent_timeout_s)
        finally:
            session.running = False

    def _data_row(self, seed: int) -> DataRow | None:
        """The data row `seed`'s episode plays, sent to its actor; None for an environment's task, which the actor
        builds itself."""
        if self.env.agent_task != "data":
            return None
        task = self.tasks(seed)
        assert isinstance(task, DataTask)
        return task.row

    def _episode(self, session: AgentSession, outcome: Outcome) -> tuple[Episode, list[Episode]]:
        """The episode (its metrics) and its trained rows, one per segment; a failed one marked with its error and
        given one row."""
        episode = Episode(session.seed, self.source, done=True)
        episode.counts[TOOL_CALLS] = float(session.tool_calls())
        segments = session.trajectories()
        error = _failure(outcome, bool(segments), self.env.agent_timeout_s)
        if error:
            episode.counts[ENV_ERROR] = 1.0
            episode.error = error
            return episode, [self._row(episode, segments[-1] if segments else None, None)]
        episode.prompt, reward, episode.success = outcome.value
        episode.turn_rewards = [(0, reward)]  # one outcome per episode, for the metrics
        return episode, [self._row(episode, segment, reward) for segment in segments]

    def _row(self, episode: Episode, segment: Segment | None, reward: float | None) -> Episode:
        """One trained row of `episode`: `segment`'s ids, the reward on its last sampled token."""
        row = replace(episode, counts=dict(episode.counts), turn_rewards=[])
        if segment is None:
            row.prompt_ids = [self.pad_id]
            return row
        row.prompt_ids, row.response_ids, row.loss_mask = segment.prompt_ids, segment.response_ids, segment.loss_mask
        row.log_probs = segment.log_probs if self.with_engine_log_probs else []
        row.transcript = [self.tokenizer.decode(segment.response_ids, skip_special_tokens=True)]
        if reward is not None:
            sampled = [i for i, m in enumerate(segment.loss_mask) if m]
            row.turn_rewards = [(sampled[-1] if sampled else 0, reward)]
        return row

    def close(self) -> None:
        """End the env-worker actors, if the agents run in any (a task closes with its episode)."""
        if self.workers is not None:
            self.workers.close()

    def _agent_metrics(self, outcomes: list[Outcome], rows: int) -> dict[str, float]:
        count = len(self.sessions)
        return {
            "rollout/agent_calls_per_episode": sum(len(s.calls) for s in self.sessions) / count,
            "rollout/agent_rows": float(rows),
            # Calls that rewrote the history: each started a segment, trained as a row of its own.
            "rollout/agent_new_segments": float(sum(max(len(s.segments) - 1, 0) for s in self.sessions)),
            "rollout/agent_rejected_calls": float(sum(s.rejected for s in self.sessions)),
            "rollout/agent_timeouts": float(sum(o.timed_out for o in outcomes)),
            "rollout/agent_errors": float(sum(o.error is not None for o in outcomes)),
        }


def _turn_args(args: GeneratingArguments, base_seed: int) -> GeneratingArguments:
    """The rollout's sampling settings, seeded per step (the session adds each call's index)."""
    return replace(args, num_return_sequences=1, seed=base_seed * TURN_SEED_STRIDE)


def _failure(outcome: Outcome, called: bool, timeout_s: float) -> str:
    """Why an episode is not trained, or "" when it is."""
    if outcome.timed_out:
        return f"the agent did not finish within env.agent_timeout_s={timeout_s:g}"
    if outcome.error is not None:
        return f"the agent raised {exception_line(outcome.error)}"
    if not called:
        return "the agent made no call to the endpoint: nothing to train"
    return ""
