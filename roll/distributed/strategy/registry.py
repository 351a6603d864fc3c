"""Strategy registry: a name in YAML -> the backend class that declared it.

A backend registers itself by subclassing `InferenceStrategy` with a `strategy_name` (see
`strategy.py`); adding a backend is one new `*_strategy.py` file in this package. The registry finds
them by importing those modules on first use. Backend modules import their engine (DeepSpeed, vLLM,
SGLang) only inside the methods that run it, so looking a backend up, or checking its config before
Ray starts, loads no engine.
"""

from __future__ import annotations

import importlib
import pkgutil

from roll.configs.schema import ConfigError, closest_spelling
from roll.configs.worker_config import WorkerConfig
from roll.distributed.strategy.strategy import REGISTERED_STRATEGIES, InferenceStrategy


def registered_strategies() -> dict[str, type[InferenceStrategy]]:
    """Every backend of this package by name (importing each backend module once)."""
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        if module.name.endswith("_strategy"):
            importlib.import_module(f"{__package__}.{module.name}")
    return REGISTERED_STRATEGIES


def strategy_class(name: str) -> type[InferenceStrategy]:
    """The backend class registered under `name`; a ValueError lists the valid names."""
    strategies = registered_strategies()
    if name not in strategies:
        raise ValueError(
            f"unknown strategy {name!r}{closest_spelling(name, strategies)}; valid: {', '.join(sorted(strategies))}"
        )
    return strategies[name]


def check_strategy_args(role: WorkerConfig) -> None:
    """Config-time check of a role's strategy: a known name, and a `strategy_config` its backend accepts.

    It also records how many of the role's ranks the backend shards one model over, which sets the
    role's data-parallel size (`WorkerConfig.dp_size`) for the batch arithmetic that follows.
    """
    if role.strategy_args is None:
        return
    name = role.strategy_args.strategy_name
    strategies = registered_strategies()
    if name not in strategies:
        raise ConfigError(
            f"{role.name}.strategy_args.strategy_name={name!r} is unknown"
            f"{closest_spelling(name, strategies)}; valid names: {', '.join(sorted(strategies))}"
        )
    strategies[name].check_config(role)
    role.model_parallel_size = strategies[name].model_parallel_size(role)
