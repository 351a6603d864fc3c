"""A user's agent function, named by `env.agent`, called with a task and an `openai` client for the endpoint.

The function is `agent(task, client)`, plain or `async`. A plain one gets an `openai.OpenAI` client, an async
one an `openai.AsyncOpenAI` client (run in an event loop of its own); both are configured with the episode's
`base_url` and the run's key, so the agent's own calls need no change. It returns the episode's reward (a
number) or its final answer (a string), which the environment's `step` then scores.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import ssl
from collections.abc import Callable
from typing import Any

from roll.configs.schema import ConfigError
from roll.utils.imports import import_object

AgentFn = Callable[[Any, Any], Any]


def load_agent(dotted: str, field: str = "env.agent") -> AgentFn:
    """The function `dotted` names, checked to take `(task, client)`; ConfigError naming `field` otherwise."""
    try:
        agent = import_object(dotted, field)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not callable(agent):
        raise ConfigError(f"{field}={dotted} is a {type(agent).__name__}, not a function")
    try:
        inspect.signature(agent).bind("task", "client")
    except TypeError as exc:
        raise ConfigError(f"{field}={dotted} must take (task, client): {exc}") from exc
    except ValueError:  # no signature to inspect (a builtin): it is called and fails at run time if wrong
        pass
    return agent


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Building the default SSL context is most of the ~85 ms an `openai.OpenAI()` takes; a batch builds one client
    # per episode (each its own connection pool), so they share this one.
    return ssl.create_default_context()


def run_agent(agent: AgentFn, task: Any, base_url: str, api_key: str, timeout_s: float) -> Any:
    """`agent(task, client)` with a client of the endpoint (no retries: a failed call is the agent's to handle)."""
    import httpx
    import openai

    options = {"base_url": base_url, "api_key": api_key, "timeout": timeout_s, "max_retries": 0}
    if inspect.iscoroutinefunction(agent):
        return asyncio.run(_run_async(agent, task, options))
    with openai.OpenAI(**options, http_client=httpx.Client(verify=_ssl_context(), timeout=timeout_s)) as client:
        return agent(task, client)


async def _run_async(agent: AgentFn, task: Any, options: dict[str, Any]) -> Any:
    import httpx
    import openai

    http_client = httpx.AsyncClient(verify=_ssl_context(), timeout=options["timeout"])
    async with openai.AsyncOpenAI(**options, http_client=http_client) as client:
        return await agent(task, client)


def play_episode(agent: AgentFn, task: Any, base_url: str, api_key: str, timeout_s: float) -> tuple[str, float, float]:
    """One episode of `task` (an `agent_tasks.AgentTask`, closed after it): (the task's text, reward, success)."""
    try:
        result = run_agent(agent, task.task, base_url, api_key, timeout_s)
        return (task.prompt, *as_reward(result, task.score))
    finally:
        task.close()


def as_reward(result: Any, score: Callable[[str], tuple[float, float]]) -> tuple[float, float]:
    """(reward, success) of what an agent returned: a number is the reward (success when positive), a string
    the final answer `score` judges; TypeError for anything else."""
    if isinstance(result, (bool, int, float)):
        return float(result), float(result > 0)
    if isinstance(result, str):
        return score(result)
    raise TypeError(
        f"the agent returned {type(result).__name__}; return the reward (a number) or the final answer (a string)"
    )
