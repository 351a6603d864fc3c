"""Agent episodes played in env-worker actors (`env.agent` with `env.num_env_workers > 0`) instead of driver threads.

Each actor builds its episodes' tasks (an environment reset with the episode's seed, in the actor; or a data row
the driver sends) and runs the user's agent against the endpoint's URL, several episodes at once (a threaded actor,
`env.max_concurrency` threads). The driver keeps the episode's deadline (`env.agent_timeout_s`) and the endpoint,
which then listens on the node's address so an actor on any node of the cluster reaches it.

An actor that dies ends the episodes it held as failed and is replaced at the next batch (one found dead between
batches too). One still running an episode past its deadline (a hung agent) is killed as soon as its batch has
ended, when its other episodes are done, and is replaced at the next: a hung agent ends only its own episode. The
training and held-out rollouts of one agent share its actors.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from roll.pipeline.agentic.agent_runner import load_agent, play_episode
from roll.pipeline.agentic.agent_tasks import DataRow, DataTask, EnvTask, reward_fn_of
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.env_workers import ACTOR_GRACE_S, actors_up

logger = logging.getLogger(__name__)


def endpoint_host(env: EnvArguments) -> str:
    """Where the endpoint listens: the node's address when agents run in env workers (on any node), else loopback."""
    return ray.util.get_node_ip_address() if env.num_env_workers else "127.0.0.1"


def agent_workers_of(env: EnvArguments) -> dict[str, AgentWorkers]:
    """The actors of each agent that plays in env workers: `""` for `env.agent`, else each agent source's name."""
    if not env.num_env_workers:
        return {}
    if env.agent is not None:
        return {"": AgentWorkers(env)}
    return {name: AgentWorkers(block) for name, block in env.source_envs().items() if block.agent is not None}


class AgentActor:
    """One env worker playing agent episodes: each builds its task, runs the agent, and scores its result."""

    def __init__(self, env: EnvArguments) -> None:
        # The client's libraries load here, before the episodes' clocks start: imported by the first episode, they
        # took its whole deadline on a loaded machine.
        import httpx  # noqa: F401
        import openai  # noqa: F401

        self.env = env
        self.agent = load_agent(env.agent or "", "env.agent")
        self.reward_fn = reward_fn_of(env.reward_fn) if env.agent_task == "data" else None

    def ready(self) -> bool:
        """Whether the actor is up: answered once its process has imported the agent."""
        return True

    def play(self, seed: int, row: DataRow | None, base_url: str, api_key: str) -> tuple[str, float, float]:
        """One episode of `seed` (its task the data `row` when given): (the task's text, reward, success)."""
        task = DataTask(row, self.reward_fn) if row is not None else EnvTask(self.env, seed)
        return play_episode(self.agent, task, base_url, api_key, self.env.agent_timeout_s)


class AgentWorkers:
    """`env.num_env_workers` agent actors; episode `i` of a batch goes to actor `i % num_env_workers`."""

    def __init__(self, env: EnvArguments) -> None:
        self.env = env
        self._remote = ray.remote(num_cpus=0, max_concurrency=env.max_concurrency)(AgentActor)
        self._actors: list[Any] = [None] * env.num_env_workers

    def start(self) -> None:
        """Replace the actors lost since the last batch (found dead now, or killed), and wait until every actor is up
        (its start-up is not counted in an episode's deadline). An actor that does not come up stays missing: its
        episodes fail."""
        for index, actor in enumerate(self._actors):
            if actor is not None and not self._answers(actor, ACTOR_GRACE_S):
                logger.warning("agent worker %d was lost between batches; it is replaced", index)
                self._kill(index)
        started = {i: self._remote.remote(self.env) for i, actor in enumerate(self._actors) if actor is None}
        for index, actor in actors_up(started, "agent worker").items():
            self._actors[index] = actor

    @staticmethod
    def _answers(actor: Any, timeout_s: float) -> bool:
        """Whether `actor` answers `ready` within `timeout_s`."""
        try:
            return ray.get(actor.ready.remote(), timeout=timeout_s)
        except (RayActorError, GetTimeoutError):
            return False

    def play(
        self, episode: int, seed: int, row: DataRow | None, base_url: str, api_key: str
    ) -> tuple[str, float, float]:
        """Episode `episode` of the batch on its actor; RuntimeError when that actor is missing or dies, or has not
        answered by the episode's deadline and the actor's grace."""
        index = episode % len(self._actors)
        actor = self._actors[index]
        if actor is None:
            raise RuntimeError(f"agent worker {index} is not running (lost, or it did not start)")
        try:
            return ray.get(
                actor.play.remote(seed, row, base_url, api_key), timeout=self.env.agent_timeout_s + ACTOR_GRACE_S
            )
        except GetTimeoutError as exc:  # abandoned at its deadline already: `kill_hung` has ended its actor
            raise RuntimeError(f"agent worker {index} did not answer within the episode's deadline") from exc
        except RayActorError as exc:
            if self._actors[index] is actor:  # not yet replaced (an abandoned episode's actor may have been)
                self._actors[index] = None
            raise RuntimeError(f"agent worker {index} died ({exc}); it is replaced at the next batch") from exc

    def kill_hung(self, episode: int) -> None:
        """Episode `episode` was abandoned at its deadline and its batch has ended: its actor, still running the hung
        agent, is killed now and replaced at the next batch."""
        self._kill(episode % len(self._actors))

    def close(self) -> None:
        """End the actors."""
        for index in range(len(self._actors)):
            self._kill(index)

    def _kill(self, index: int) -> None:
        """End actor `index` (if running) and leave its slot empty."""
        if self._actors[index] is not None:
            ray.kill(self._actors[index])
            self._actors[index] = None
