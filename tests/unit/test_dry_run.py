"""dry_run=true: the plan of a validated run (placement, batches, memory per rank), printed without Ray."""

from __future__ import annotations

import time

import pytest
import ray

from roll.configs.loader import load_pipeline_config, yaml_names
from roll.pipeline.base.dry_run.plan import dry_run_report
from tests.conftest import CONFIG_DIR
from tests.unit.test_hydra_configs import PIPELINE_SCHEMAS, compose_config

# Qwen2.5-0.5B's shape as a tiny:// spec: the GPU recipe's plan without its weights.
QWEN_05B = (
    "tiny://qwen2?hidden_size=896&num_layers=24&num_heads=14&num_kv_heads=2&intermediate_size=4864"
    "&max_position_embeddings=32768"
)


def report(name: str, *overrides: str) -> list[str]:
    config = load_pipeline_config(
        compose_config(name, list(overrides)), PIPELINE_SCHEMAS[name], yaml_names([CONFIG_DIR])
    )
    return dry_run_report(config)


def test_the_default_run_plans_every_rank_its_batches_and_memory_without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("a dry run without an address must not start Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    lines = report("rlvr_arithmetic", "pretrain=tiny://qwen2")
    text = "\n".join(lines)
    assert "actor_train rank 1: node 0, devices [1]" in text and "rewards.math rank 0: node 0, 1.0 CPU" in text
    assert "rollout: 32 prompts x 8 samples = 256 samples per step" in text
    assert "-> 2 optimizer step(s) per RL step" in text
    memory = [line for line in lines if line.startswith(("actor_train (", "actor_infer (", "reference ("))]
    assert len(memory) == 3 and all(line.endswith(": fits") for line in memory), memory
    assert not any(line.startswith("rewards.math (") for line in lines)  # reward workers hold no model


def test_the_gpu_recipe_plans_on_a_cpu_machine_from_a_spec_of_its_model() -> None:
    started = time.perf_counter()
    lines = report("rlvr_qwen2.5_0.5b_8gpu", f'pretrain="{QWEN_05B}"', "data.train_file=", "data.eval_file=")
    assert time.perf_counter() - started < 15  # the spec is read, not built
    text = "\n".join(lines)
    assert "actor_train rank 7: node 0, devices [7]" in text and "actor_infer (vllm, 8 ranks)" in text
    # ZeRO-3 over 8 ranks: a rank holds 1/8 of the fp32 Adam states of ~0.5B parameters (~0.33 GiB).
    assert "Adam m+v 0.3" in text


def test_an_agentic_run_plans_its_episodes_turn_budget_and_env_role() -> None:
    text = "\n".join(report("agentic_frozen_lake", "pretrain=tiny://qwen2", "env.num_env_workers=3"))
    assert "rollout: 16 seeds x 8 episodes = 128 samples per step" in text
    assert "128 episodes per step of up to 10 turns; each turn samples <= 2 tokens, an observation <= 32" in text
    assert "<= 256 response tokens per episode" in text and "in 3 env-worker actor(s)" in text
    assert "critic (deepspeed_train, 2 ranks)" in text


def test_a_mixed_agentic_run_plans_each_source() -> None:
    text = "\n".join(report("agentic_mixed"))
    assert "env calculator, guess_number: 32 episodes per step of up to 5 turns" in text
    for source, env in (("calculator", "calculator_arithmetic"), ("guess_number", "guess_number")):
        assert f"env source {source}: {env} with " in text
    assert "weight 0.5 (50%): about 16.0 of 32 episodes per step (whole groups), 20 of 32 held-out seeds" in text
