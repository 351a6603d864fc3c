"""Strategy registry: a name in YAML -> the backend class, imported only when a worker asks for it.

Importing roll never imports DeepSpeed, vLLM or SGLang; only `create_strategy` does, for the one
backend a worker uses.
"""

from __future__ import annotations

import importlib
from typing import Any

from roll.configs.schema import closest_spelling

STRATEGIES: dict[str, str] = {
    "deepspeed_train": "roll.distributed.strategy.deepspeed_strategy.DeepSpeedTrainStrategy",
    "deepspeed_infer": "roll.distributed.strategy.deepspeed_strategy.DeepSpeedInferStrategy",
    "hf_infer": "roll.distributed.strategy.hf_strategy.HfInferStrategy",
    "vllm": "roll.distributed.strategy.vllm_strategy.VllmStrategy",
    "sglang": "roll.distributed.strategy.sglang_strategy.SglangStrategy",
}

# Checks of a backend's own config block that need no backend import; they run at config
# validation time, before any Ray actor starts.
CONFIG_CHECKS: dict[str, str] = {
    "deepspeed_train": "roll.distributed.strategy.deepspeed_config.check_train_config",
    "deepspeed_infer": "roll.distributed.strategy.deepspeed_config.check_infer_config",
    "vllm": "roll.distributed.strategy.vllm_strategy.check_vllm_config",
    "sglang": "roll.distributed.strategy.sglang_strategy.check_sglang_config",
}


def _import(dotted: str) -> Any:
    module_name, attr = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), attr)


def check_strategy_config(worker_config: Any) -> None:
    """Validate a role's `strategy_config` against its backend's rules (raise ConfigError)."""
    name = worker_config.strategy_args.strategy_name
    if name in CONFIG_CHECKS:
        _import(CONFIG_CHECKS[name])(worker_config)


def strategy_class(name: str) -> type:
    """Import and return the class registered under `name`; a ValueError lists the valid names."""
    if name not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {name!r}{closest_spelling(name, STRATEGIES)}; valid: {', '.join(STRATEGIES)}"
        )
    return _import(STRATEGIES[name])


def create_strategy(name: str, worker: Any) -> Any:
    """Instantiate the strategy `name` for `worker` (which carries the role's config and ranks)."""
    return strategy_class(name)(worker)
