"""What an agent episode (`env.agent`) is given and how its final answer is scored: an environment's reset, or a row
of the `data` block (`env.agent_task=data`).

An environment task is `env.name` reset with the episode's seed; its `step` scores the agent's final answer. A data
task is a row of RLVR's data (its prompt or conversation, its answer): the agent gets the prompt's text when the
conversation is one user turn, else the conversation (a list of `{role, content}`, `data.system_prompt` first when
set), and `env.reward_fn(prompt, final_answer, answer)` scores it. Training seeds walk the training rows (each pass
in an order of its own), held-out seed `env.eval_seed_offset + i` is held-out row `i`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from roll.configs.data_config import DataArguments
from roll.configs.schema import ConfigError
from roll.envs.protocol import SUCCESS
from roll.pipeline.agentic.agentic_config import EnvArguments, close_env
from roll.rewards.reward_process import import_reward_fn

logger = logging.getLogger(__name__)


class AgentTask(Protocol):
    """One episode's task: `task` goes to the agent, `prompt` is its text for the sample log."""

    task: Any
    prompt: str

    def score(self, answer: str) -> tuple[float, float]:
        """(reward, success) of the agent's final answer."""
        ...

    def close(self) -> None:
        """Release what the task holds."""
        ...


class EnvTask:
    """An environment of `env.name` reset with `seed`: its first observation is the task, its `step` the scorer."""

    def __init__(self, env: EnvArguments, seed: int) -> None:
        self.environment = env.make_env()
        try:
            self.task, _ = self.environment.reset(seed=seed)
        except BaseException:
            self.close()
            raise
        self.prompt = str(self.task)

    def score(self, answer: str) -> tuple[float, float]:
        """The environment's reward for `answer`, and its `success` (else reward > 0)."""
        _, reward, _, _, info = self.environment.step(answer)
        return float(reward), float(info.get(SUCCESS, float(reward > 0)))

    def close(self) -> None:
        """Close the environment."""
        close_env(self.environment)


@dataclass(frozen=True)
class DataRow:
    """A data row as an agent's task: what the agent gets, the prompt's text, the answer the reward checks."""

    task: Any
    prompt: str
    answer: str


@dataclass
class DataTask:
    """A data row's episode: its final answer scored by the reward function against the row's answer."""

    row: DataRow
    reward_fn: Callable[[str, str, str], float]

    @property
    def task(self) -> Any:
        """What the agent is given."""
        return self.row.task

    @property
    def prompt(self) -> str:
        """The prompt's text."""
        return self.row.prompt

    def score(self, answer: str) -> tuple[float, float]:
        """The reward function's score; success when it is at least 1 (as RLVR's `rollout/accuracy` counts)."""
        reward = float(self.reward_fn(self.row.prompt, answer, self.row.answer))
        return reward, float(reward >= 1.0)

    def close(self) -> None:
        """Nothing to release."""


class DataTasks:
    """The rows of the `data` block as agent tasks, by episode seed."""

    def __init__(self, train: list[DataRow], held_out: list[DataRow], env: EnvArguments) -> None:
        self.train, self.held_out = train, held_out
        self.eval_seed_offset = env.eval_seed_offset
        self.reward_fn = reward_fn_of(env.reward_fn)

    @classmethod
    def load(cls, data: DataArguments, env: EnvArguments) -> DataTasks:
        """The training and held-out rows of `data` (its files, else the built-in arithmetic task); ConfigError
        naming the field when a file or column is wrong, or when there are fewer held-out rows than
        `env.eval_episodes`."""
        from roll.datasets.prompt_dataset import split_tables, task_table
        from roll.datasets.sources import quiet_progress, to_conversations

        with quiet_progress():
            tables = split_tables(data, lambda table, source: to_conversations(table, data, source), task_table(data))
        train, held_out = ([_row(row, data.system_prompt) for row in table.to_list()] for table, _ in tables)
        if not train:
            raise ConfigError(f"env.agent_task=data: {tables[0][1]} has no rows to train on")
        if len(held_out) < env.eval_episodes:
            raise ConfigError(
                f"env.eval_episodes={env.eval_episodes} held-out episodes need as many held-out rows, and "
                f"{tables[1][1]} has {len(held_out)}; lower env.eval_episodes or add rows"
            )
        return cls(train, held_out, env)

    def row(self, seed: int) -> DataRow:
        """Seed `eval_seed_offset + i`: held-out row i; a training seed: a training row, each pass over them in an
        order drawn from the pass's number."""
        if seed >= self.eval_seed_offset:
            return self.held_out[seed - self.eval_seed_offset]
        rounds, position = divmod(seed, len(self.train))
        return self.train[int(np.random.default_rng([rounds]).permutation(len(self.train))[position])]

    def task(self, seed: int) -> DataTask:
        """The episode of seed `seed`."""
        return DataTask(self.row(seed), self.reward_fn)


def _row(row: dict[str, Any], system_prompt: str) -> DataRow:
    messages = list(row["messages"])
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    prompt = "\n".join(turn["content"] for turn in messages)
    single = len(messages) == 1
    return DataRow(messages[0]["content"] if single else messages, prompt, row["answer"])


def reward_fn_of(dotted: str) -> Callable[[str, str, str], float]:
    """The reward function `env.reward_fn` names; ConfigError naming the field when it does not import."""
    try:
        return import_reward_fn(dotted)
    except ValueError as exc:
        raise ConfigError(f"env.reward_fn: {exc}") from exc


def task_maker(env: EnvArguments, data: DataArguments | None) -> Callable[[int], AgentTask]:
    """The task of each episode seed: from the rows of `data` with `env.agent_task=data`, else an environment's."""
    if env.agent_task == "data":
        if data is None:
            raise ConfigError("env.agent_task=data reads the data block, and none was given")
        return DataTasks.load(data, env).task
    return lambda seed: EnvTask(env, seed)
