"""The agentic guess_number recipe end to end with real Ray, DeepSpeed and hf_infer: two steps of multi-turn
episodes, their metrics, a checkpoint, and a resume that recomputes the second step the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline
from tests.pipeline_runs import run_pipeline
from tests.unit.test_hydra_configs import load_config

pytestmark = pytest.mark.slow

# Two steps of 4 seeds x 4 episodes, one rank per role on one shared device.
FAST = [
    "pretrain='tiny://qwen2?hidden_size=64&num_heads=2&num_kv_heads=1&num_layers=1'",
    "rollout_batch_size=4",
    "max_steps=2",
    "eval_steps=2",
    "save_steps=1",
    "env.eval_episodes=8",
    "actor_train.training_args.per_device_train_batch_size=16",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "actor_infer.generating_args.num_return_sequences=4",
    "actor_train.device_mapping=0",
    "actor_infer.device_mapping=0",
    "devices_per_node=1",
    "platform=cpu",
]


def run(output: Path, *extra: str) -> list[dict]:
    config: RLVRConfig = load_config("agentic_guess_number", [*FAST, f"output_dir={output}", *extra])
    return run_pipeline(RLVRPipeline, config)[1]


def test_two_steps_of_episodes_train_checkpoint_and_resume(ray_session: None, tmp_path: Path) -> None:
    rows = run(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 2]
    for step in (1, 2):
        row = rows[step]
        for key in ("rollout/success", "rollout/turns_mean", "rollout/invalid_action_rate", "actor/loss"):
            assert key in row, (step, key)
        assert 1 <= row["rollout/turns_mean"] <= 5 and row["rollout/env_errors"] == 0
    assert 0 <= rows[2]["val/accuracy"] <= 1 and 0 <= rows[2]["val/sampled_success"] <= 1
    run_dir = tmp_path / "agentic_guess_number"
    assert (run_dir / "checkpoints" / "step_1" / "driver_state.json").is_file()

    resumed = run(tmp_path, "resume_from_checkpoint=step_1")
    assert [row["step"] for row in resumed] == [0, 1, 2]
    for key in ("rollout/success", "rollout/turns_mean", "rollout/response_length_mean", "actor/loss"):
        assert resumed[2][key] == pytest.approx(rows[2][key], rel=1e-6, abs=1e-9), key


def test_episodes_played_during_the_previous_update_by_env_workers(ray_session: None, tmp_path: Path) -> None:
    """async_generation_ratio=1 with env: each step's episodes are played (in a driver thread, the environments
    in two env-worker actors) while the previous step trains, by weights at most one version old."""
    rows = run(
        tmp_path,
        "max_steps=3",
        "eval_steps=3",
        "async_generation_ratio=1",
        "algorithm.tis_cap=2.0",
        "actor_infer.device_mapping=1",
        "devices_per_node=2",
        "env.num_env_workers=2",
    )
    steps = rows[1:]
    assert [row["rollout/staleness_max"] for row in steps] == [0.0, 1.0, 1.0]
    for row in steps:
        assert 1 <= row["rollout/turns_mean"] <= 5 and row["rollout/env_errors"] == 0
        assert 0 < row["actor/tis_weight_mean"] <= 2.0
    assert 0 <= rows[-1]["val/accuracy"] <= 1


def test_frozen_lake_trains_actor_and_critic_with_gae(ray_session: None, tmp_path: Path) -> None:
    """The frozen_lake recipe's GAE path: per-turn rewards and turn discounts reach a critic that trains."""
    tiny = "'tiny://qwen2?hidden_size=64&num_heads=2&num_kv_heads=1&num_layers=1'"
    overrides = [
        *[o for o in FAST if not o.startswith(("pretrain", "save_steps"))],
        f"pretrain={tiny}",
        "max_steps=1",
        "eval_steps=1",
        "critic.device_mapping=0",
        "critic.training_args.per_device_train_batch_size=16",
        "critic.training_args.gradient_accumulation_steps=1",
        f"output_dir={tmp_path}",
    ]
    config: RLVRConfig = load_config("agentic_frozen_lake", overrides)
    rows = run_pipeline(RLVRPipeline, config)[1]
    step = rows[1]
    assert step["critic/grad_norm"] > 0 and step["actor/grad_norm"] > 0
    assert 1 <= step["rollout/turns_mean"] <= 10 and step["rollout/env_errors"] == 0


def test_vllm_plays_the_episodes_token_in_token_out(ray_session: None, tmp_path: Path) -> None:
    """actor_infer on vLLM (CPU build) plays multi-turn episodes: each turn is a generate call on the ids so far.
    With the TIS correction the engine reports its log-probs of the sampled tokens; the trainer's recomputed
    log-probs of the same ids agree with them, so the ids trained on are the ids vLLM saw and sampled."""
    rows = run(
        tmp_path,
        "max_steps=1",
        "eval_steps=1",
        "save_steps=0",
        "devices_per_node=2",
        "actor_infer.device_mapping=1",
        "actor_infer.strategy_args.strategy_name=vllm",
        "algorithm.tis_cap=2.0",
    )
    step = rows[1]
    assert 1 <= step["rollout/turns_mean"] <= 5 and step["rollout/env_errors"] == 0
    # One policy version, so the engine's and the trainer's log-probs differ by numerics only.
    assert step["actor/tis_weight_mean"] == pytest.approx(1.0, abs=0.05)
    assert 0 <= rows[1]["val/accuracy"] <= 1
