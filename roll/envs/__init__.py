"""Text environments for multi-turn agentic RL: the protocol, the registry, the GEM adapter, tools, built-in tasks.

What it holds: `protocol` (the `Env` contract, GEM's `gem.Env`, and the checks of what an environment
returns), `registry` (names, dotted import paths and `gem:<env_id>` to environments), `gem_adapter`,
`manager` (many environments stepped in threads with a concurrency cap and a per-call timeout, no Ray),
`deadline` (the thread runner both the manager and the tools use), `tool_calls`, `calculator`, `tools`
(the tool-calling wrapper and its built-in tools), and `builtin/` (guess_number, calculator_arithmetic,
frozen_lake).

It may import roll.utils and roll.rewards (the code sandbox), never a layer above; `gem` and
`gymnasium` are imported only by the environments that use them.
"""

from roll.envs.manager import EnvManager, EnvResult
from roll.envs.protocol import Env
from roll.envs.registry import env_factory, make_env, register_env, registered_envs
from roll.envs.tools import Tool, ToolEnv, resolve_tool

__all__ = [
    "Env",
    "EnvManager",
    "EnvResult",
    "Tool",
    "ToolEnv",
    "env_factory",
    "make_env",
    "register_env",
    "registered_envs",
    "resolve_tool",
]
