"""The `env` block of an RLVR config: multi-turn episodes with an environment instead of prompts and rewards.

With `env` set, each step's samples are episodes of the named environment (`roll.envs`), stepped in the
driver (`multi_turn`); the reward clusters and the prompt data are not used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from roll.configs.schema import DOTTED_PATH, ConfigError, any_value, check
from roll.envs.protocol import Env
from roll.envs.registry import env_factory, make_env
from roll.envs.tools import ToolEnv
from roll.pipeline.agentic.observations import ObservationEncoder
from roll.pipeline.agentic.sources import EnvSource, check_sources, draw_sources
from roll.utils.imports import exception_line

logger = logging.getLogger(__name__)

DEFAULT_ENV = "guess_number"


@dataclass
class EnvArguments:
    """The environment, its turn and token budgets, and its held-out evaluation."""

    # A registered name (guess_number, calculator_arithmetic, frozen_lake), a dotted path or `gem:<env_id>`.
    name: str = field(
        default=DEFAULT_ENV, metadata=check(nonempty=True, hint="e.g. guess_number or package.module.MyEnv")
    )
    kwargs: dict[str, Any] = field(
        default_factory=dict, metadata=any_value("the environment's constructor arguments, checked by make_env")
    )
    # Several environments in one run, each episode's drawn by weight from its seed (docs/agentic.md, "Several
    # environments in one run"); they replace `name` and `kwargs`, and share the budgets below.
    sources: list[EnvSource] = field(
        default_factory=list, metadata=any_value("each source's fields and their names are checked by validate")
    )
    max_turns: int = field(default=5, metadata=check(ge=1))
    # The whole response of an episode (actions and observations after the first); each turn samples at most
    # actor_infer.generating_args.max_new_tokens of it.
    max_trajectory_tokens: int = field(default=64, metadata=check(ge=1))
    # A longer observation is cut to this many tokens and its episode ends as truncated; the first one too.
    max_observation_tokens: int = field(default=32, metadata=check(ge=1))
    # The episode's score for GRPO/RLOO: the sum of its turn rewards, or the last turn's.
    trajectory_score: Literal["sum", "last"] = "sum"
    # GAE and REINFORCE++: the discount from one turn to the next (algorithm.gamma still discounts per token).
    turn_gamma: float = field(default=1.0, metadata=check(ge=0, le=1))
    eval_episodes: int = field(default=64, metadata=check(ge=1))
    # Held-out seeds are eval_seed_offset + 0..eval_episodes-1; training seeds count up from 0 and stay below it.
    eval_seed_offset: int = field(default=1_000_000_000, metadata=check(ge=1))
    apply_chat_template: bool = False
    timeout_s: float = field(default=30.0, metadata=check(gt=0))
    max_concurrency: int = field(default=8, metadata=check(ge=1))
    # 0: the environments run in the driver (cheap games). N: they are spread over N CPU Ray actors, the env
    # role (roll/pipeline/agentic/env_workers.py), each calling its environments with max_concurrency threads.
    num_env_workers: int = field(default=0, metadata=check(ge=0))
    # A user's agent `package.module.function(task, client)`, plain or async (docs/agentic.md, "Bring your own
    # agent"): it plays each episode through roll's OpenAI-compatible endpoint, the task being the environment's
    # first observation; it returns the reward, or its final answer for the environment's `step` to score.
    agent: str | None = field(default=None, metadata=check(DOTTED_PATH))
    # Where an agent's tasks come from: "env", `name` reset with the episode's seed (its `step` scores the final
    # answer); "data", the rows of the `data` block (RLVR's prompts and answers), the final answer scored by
    # `reward_fn` (docs/agentic.md, "A data row as the task").
    agent_task: Literal["env", "data"] = "env"
    # With agent_task=data: `package.module.function(prompt, response, answer) -> score`, as a reward cluster's.
    reward_fn: str = field(default="roll.rewards.functions.math_reward", metadata=check(DOTTED_PATH))
    # An agent's whole episode: one still running then ends only its own episode, which is not trained.
    agent_timeout_s: float = field(default=120.0, metadata=check(gt=0))
    # Two characters, e.g. "<>": the endpoint also reads the bracket form `<calc 12*34>` of a requested tool as a
    # tool call (a tiny model's character vocabulary has no braces for Hermes JSON). "": Hermes only.
    agent_tool_brackets: str = field(default="", metadata=check(pattern=r"(..)?", expect="two characters such as <>"))
    # The fields `name` and `kwargs` stand for in errors: env.sources[i].env and .kwargs for a source's block.
    name_field: str = field(default="env.name", init=False, repr=False, compare=False)
    kwargs_field: str = field(default="env.kwargs", init=False, repr=False, compare=False)

    def make_env(self) -> Env:
        """A new environment of this block: `name` built with `kwargs`."""
        return make_env(self.name, self.kwargs, self.name_field)

    def source_envs(self) -> dict[str, EnvArguments]:
        """Each source's block by source name: with `sources`, this block with a source's environment and kwargs;
        without, this block under its `name`."""
        if not self.sources:
            return {self.name: self}
        blocks = {}
        for i, source in enumerate(self.sources):
            block = replace(self, name=source.env, kwargs=dict(source.kwargs), sources=[], agent=source.agent)
            block.name_field, block.kwargs_field = f"env.sources[{i}].env", f"env.sources[{i}].kwargs"
            blocks[source.name] = block
        return blocks

    def source_names(self, seeds: list[int]) -> list[str]:
        """The source of each seed's episode (`draw_sources`), or `name` for every one without `sources`."""
        return draw_sources(seeds, self.sources) if self.sources else [self.name] * len(seeds)

    def eval_seeds(self) -> list[int]:
        """The held-out seeds, never trained on."""
        return [self.eval_seed_offset + i for i in range(self.eval_episodes)]

    def describe(self, episodes: int, max_new_tokens: int) -> list[str]:
        """The dry run's lines: the turn and token budgets of a step's `episodes`, where the environments run, the
        tools the prompt lists, and with `sources` each source's share of the episodes."""
        label = ", ".join(source.name for source in self.sources) if self.sources else self.name
        if self.agent_task == "data":
            label = "data rows"
        where = (
            "in the driver"
            if not self.num_env_workers
            else f"in {min(self.num_env_workers, episodes)} env-worker actor(s) (num_cpus=0)"
            + (" per source" if self.sources else "")
        )
        return [
            f"env {label}: {episodes} episodes per step of up to {self.max_turns} turns; each turn samples <= "
            f"{max_new_tokens} tokens, an observation <= {self.max_observation_tokens}; "
            f"<= {self.max_trajectory_tokens} response tokens per episode",
            f"env {label}: environments {where}, {self.max_concurrency} calls at once, "
            f"{self.timeout_s:g} s per call; {self.eval_episodes} held-out seeds from {self.eval_seed_offset}"
            if self.agent_task == "env"
            else f"env {label}: {self.eval_episodes} held-out rows (data.eval_file, or the built-in task's)",
            *self._describe_sources(episodes),
            *(line for block in self.source_envs().values() for line in block._describe_tools()),
            *(
                [
                    f"env {label}: each episode played by the agent {self.agent} "
                    + ("in the driver" if not self.num_env_workers else "in the env-worker actors")
                    + " through the OpenAI-compatible endpoint on "
                    + ("127.0.0.1" if not self.num_env_workers else "the driver node's address")
                    + f", {self.max_concurrency} at once, {self.agent_timeout_s:g} s each"
                    + (f"; its final answer scored by {self.reward_fn}" if self.agent_task == "data" else "")
                ]
                if self.agent
                else []
            ),
        ]

    def _describe_sources(self, episodes: int) -> list[str]:
        """Each source's environment, its expected share of a step's episodes and its held-out seeds."""
        total = sum(source.weight for source in self.sources)
        held_out = self.source_names(self.eval_seeds())
        return [
            f"env source {source.name}: {source.env} with {source.kwargs}"
            + (f", played by the agent {source.agent}" if source.agent else "")
            + f", weight {source.weight:g} "
            f"({source.weight / total:.0%}): about {episodes * source.weight / total:.1f} of {episodes} episodes per "
            f"step (whole groups), {held_out.count(source.name)} of {self.eval_episodes} held-out seeds"
            for source in self.sources
        ]

    def _describe_tools(self) -> list[str]:
        tools = self.tool_schemas() if self.apply_chat_template and self.agent_task == "env" else []
        if not tools:
            return []
        names = ", ".join(_tool_name(tool) for tool in tools)
        return [f"env {self.name}: tools listed in the prompt by the chat template: {names}"]

    def validate(self, max_new_tokens: int) -> None:
        """Every environment (`name`, or each of `sources`) resolves and builds with its kwargs (one is built, then
        closed), the sources are well formed, and the trajectory budget holds one turn; ConfigError naming the
        field."""
        self._check_reward_fn()
        if self.sources:
            self._check_sources()
        if self.agent_task == "data":
            self._check_data_tasks()
        for block in self.source_envs().values() if self.agent_task == "env" else []:
            try:
                env_factory(block.name, block.name_field)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
            block._check_builds()
        if self.sources:
            self._check_held_out_sources()
        if self.agent is not None:
            self._check_agent()
        if self.max_trajectory_tokens < max_new_tokens:
            raise ConfigError(
                f"env.max_trajectory_tokens={self.max_trajectory_tokens} cannot hold one turn of "
                f"actor_infer.generating_args.max_new_tokens={max_new_tokens}; raise it to at least {max_new_tokens}"
            )

    def _check_sources(self) -> None:
        """The sources' fields and names; no `name`, `kwargs` or `agent` beside them."""
        check_sources(self.sources)
        if self.name != DEFAULT_ENV or self.kwargs:
            raise ConfigError(
                f"env.sources names each source's environment and kwargs; remove env.name={self.name} and "
                f"env.kwargs={self.kwargs} (or drop env.sources for one environment)"
            )
        if self.agent is not None:
            raise ConfigError(
                f"env.agent={self.agent} plays one environment's tasks and env.sources mixes environments: name the "
                "agent in the source it plays (env.sources[i].agent) instead"
            )
        if self.agent_task == "data":
            raise ConfigError(
                "env.agent_task=data gives one agent the data rows; the agents of env.sources play environments"
            )
        for i, source in enumerate(self.sources):
            if source.agent is not None:
                from roll.pipeline.agentic.agent_runner import load_agent

                load_agent(source.agent, f"env.sources[{i}].agent")

    def _check_data_tasks(self) -> None:
        """An agent plays the data rows, scored by `reward_fn`; no environment beside them (the rows themselves are
        read by the RLVR config's check, which has the data block)."""
        if self.agent is None:
            raise ConfigError("env.agent_task=data gives an agent the data rows as tasks; set env.agent")
        if self.name != DEFAULT_ENV or self.kwargs:
            raise ConfigError(
                f"env.agent_task=data takes the agent's tasks from the data block, not from an environment; remove "
                f"env.name={self.name} and env.kwargs={self.kwargs} (or set env.agent_task=env)"
            )

    def _check_reward_fn(self) -> None:
        """`reward_fn` imports (checked even where no data task reads it: a set field that cannot work is an error)."""
        from roll.rewards.reward_process import import_reward_fn

        try:
            import_reward_fn(self.reward_fn)
        except ValueError as exc:
            raise ConfigError(f"env.reward_fn: {exc}") from exc

    def _check_held_out_sources(self) -> None:
        """Each source meets at least one held-out seed: its `val/<source>/...` metrics need one."""
        held_out = set(self.source_names(self.eval_seeds()))
        for i, source in enumerate(self.sources):
            if source.name not in held_out:
                raise ConfigError(
                    f"env.sources[{i}] ({source.name}, weight {source.weight:g}) draws none of the "
                    f"env.eval_episodes={self.eval_episodes} held-out seeds; raise env.eval_episodes or its weight"
                )

    def has_agents(self) -> bool:
        """An agent plays this block's episodes, or some of its sources'."""
        return self.agent is not None or any(source.agent for source in self.sources)

    def _check_agent(self) -> None:
        """The agent imports and takes (task, client)."""
        from roll.pipeline.agentic.agent_runner import load_agent

        load_agent(self.agent or "", "env.agent")

    def _check_builds(self) -> None:
        """Build one environment and close it: a constructor that raises, or rejects `kwargs`, would otherwise fail
        every episode in the env workers, and the run would train on nothing."""
        try:
            env = self.make_env()
        except ValueError as exc:  # make_env's own: kwargs the constructor does not take, or not an environment
            raise ConfigError(f"{exc} ({self.kwargs_field}={self.kwargs})") from exc
        except Exception as exc:
            raise ConfigError(
                f"{self.name_field}={self.name} with {self.kwargs_field}={self.kwargs} cannot be built: "
                f"{exception_line(exc)}"
            ) from exc
        try:
            close_env(env)
        except Exception as exc:
            logger.warning(
                "%s=%s: closing the environment built to check it raised %s", self.name_field, self.name, exc
            )

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The function schemas of the environment's tools (its `tool_schemas()`, as a ToolEnv has; [] without):
        one environment is built to ask, then closed. The chat template lists them in the prompt."""
        env = self.make_env()
        try:
            schemas = getattr(env, "tool_schemas", None)
            return list(schemas()) if callable(schemas) else []
        finally:
            close_env(env)

    def check_chat_template(self, tokenizer: Any, model: str) -> None:
        """With `apply_chat_template`: the policy's template renders a user turn, a tool turn when the environment
        calls tools (a ToolEnv), and its tools' schemas within `max_observation_tokens`; ConfigError naming the
        field otherwise. A template that ignores `tools` is a warning: the model is not told the tools."""
        if not self.apply_chat_template or self.agent_task == "data":  # an agent's requests name their own tools
            return
        if self.sources:
            for block in self.source_envs().values():
                block.check_chat_template(tokenizer, model)
            return
        fix = "use a model whose chat template has them, or set env.apply_chat_template=false"
        try:
            encoder = ObservationEncoder(tokenizer, chat_template=True)
            encoder.first("observation")
            encoder.next("observation", "user")
        except Exception as exc:  # a template's own error (jinja, a raise_exception in it) says why
            raise ConfigError(
                f"env.apply_chat_template=true, but the chat template of {model} cannot render the next user turn "
                f"after an assistant turn ({exc}); {fix}"
            ) from exc
        env = self.make_env()
        try:
            if isinstance(env, ToolEnv):
                encoder.next("tool result", "tool")
        except Exception as exc:
            raise ConfigError(
                f"env.apply_chat_template=true and {self.name_field}={self.name} answers tool calls as tool turns, "
                f"but the chat template of {model} cannot render a 'tool' message ({exc}); {fix}"
            ) from exc
        finally:
            close_env(env)
        self._check_tools_in_prompt(ObservationEncoder(tokenizer, True, self.tool_schemas()), model)

    def _check_tools_in_prompt(self, encoder: ObservationEncoder, model: str) -> None:
        if not encoder.tools:
            return
        names = ", ".join(_tool_name(tool) for tool in encoder.tools)
        try:
            renders = encoder.renders_tools()
            size = len(encoder.first(""))
        except Exception as exc:
            raise ConfigError(
                f"{self.name_field}={self.name} has tools ({names}), but the chat template of {model} cannot render "
                f"them ({exc}); use a model whose template takes `tools`, or set env.apply_chat_template=false"
            ) from exc
        if not renders:
            logger.warning(
                "%s=%s has tools (%s), but the chat template of %s does not render `tools`: the model is not "
                "told which tools exist. Describe them in the environment's observation, or use a model whose "
                "template lists tools (Qwen2.5, Hermes).",
                self.name_field,
                self.name,
                names,
                model,
            )
        elif size > self.max_observation_tokens:
            raise ConfigError(
                f"the first observation of {self.name_field}={self.name} lists its tools ({names}) in {size} tokens of "
                f"{model}'s chat template before the task itself, more than env.max_observation_tokens="
                f"{self.max_observation_tokens}; raise it (a longer first observation is cut from its start, where "
                "the tools are)"
            )


def _tool_name(schema: dict[str, Any]) -> str:
    return str(schema.get("function", schema).get("name", "?"))


def close_env(env: Env) -> None:
    """`env.close()`, for an environment that has one."""
    close = getattr(env, "close", None)
    if callable(close):
        close()
