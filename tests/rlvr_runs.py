"""The short RLVR runs of the integration tests: one definition of their overrides, configs and runs.

Every RLVR YAML the tests run (prompt/answer arithmetic, on-policy distillation, the agentic recipes) is cut
short by the same overrides (SHORT); the arithmetic YAML then runs the tiny untrained model on two device slots
(FAST), on-policy distillation and the agentic recipes a 64-wide one-layer policy on one (SMALL_ON_ONE_DEVICE).
The lists are Hydra overrides, so tests that start an entry point pass them on its command line unchanged.
"""

from __future__ import annotations

from pathlib import Path

from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline
from tests.pipeline_runs import run_pipeline
from tests.unit.test_hydra_configs import load_config

# Any RLVR YAML: 4 samples a prompt (or episodes a seed), no gradient accumulation, on the CPU platform.
SHORT = (
    "platform=cpu",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "actor_infer.generating_args.num_return_sequences=4",
)

# rlvr_arithmetic.yaml on the tiny untrained model: 8 prompts a step (32 samples of at most 4 tokens, one optimizer
# step on two ranks), 16 held-out prompts, every role on both of 2 device slots.
FAST = (
    *SHORT,
    "actor_infer.generating_args.max_new_tokens=4",
    "pretrain=tiny://qwen2",
    "rollout_batch_size=8",
    "eval_batch_size=16",
    "actor_train.training_args.per_device_train_batch_size=16",
    "devices_per_node=2",
)

# FAST on one device slot, one rank per role: three worker start-ups fewer, for tests whose subject is not the
# data-parallel split. The 32 samples stay one optimizer step.
ONE_RANK = (
    "devices_per_node=1",
    "actor_train.device_mapping=0",
    "actor_infer.device_mapping=0",
    "reference.device_mapping=0",
    "actor_train.training_args.per_device_train_batch_size=32",
)

# The YAMLs whose policy is a student (on-policy distillation) or plays an environment (the agentic recipes):
# a 64-wide one-layer policy, 4 prompts or seeds a step (16 samples, one optimizer step), one device slot.
SMALL_ON_ONE_DEVICE = (
    *SHORT,
    "pretrain='tiny://qwen2?hidden_size=64&num_heads=2&num_kv_heads=1&num_layers=1'",
    "rollout_batch_size=4",
    "actor_train.training_args.per_device_train_batch_size=16",
    "devices_per_node=1",
    "actor_train.device_mapping=0",
    "actor_infer.device_mapping=0",
)

# A reward that varies even among an untrained model's samples: non-zero advantages, hence gradients.
PARITY_REWARD = "rewards.math.reward_fn=tests.reward_functions.parity_reward"


def arithmetic_config(output: Path, *overrides: str) -> RLVRConfig:
    """rlvr_arithmetic.yaml as FAST runs it, writing under `output`, then `overrides`."""
    return load_config("rlvr_arithmetic", [*FAST, f"output_dir={output}", *overrides])


def small_policy_config(name: str, output: Path, *overrides: str) -> RLVRConfig:
    """RLVR YAML `name` as SMALL_ON_ONE_DEVICE runs it, writing under `output`, then `overrides`."""
    return load_config(name, [*SMALL_ON_ONE_DEVICE, f"output_dir={output}", *overrides])


def run_rlvr(config: RLVRConfig) -> list[dict]:
    """Run RLVR with `config` to the end in this process; the metrics rows it logged."""
    return run_pipeline(RLVRPipeline, config)[1]


def block(name: str) -> str:
    """The override that makes `name` (an examples/config/deepspeed_*.yaml block) actor_train's strategy."""
    return f"actor_train.strategy_args.strategy_config=${{{name}}}"


def assert_zero_stage(config: RLVRConfig, stage: int) -> None:
    """actor_train of `config` trains at ZeRO stage `stage`."""
    assert config.actor_train.strategy_args.strategy_config["zero_optimization"]["stage"] == stage
