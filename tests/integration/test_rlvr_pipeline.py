"""The RLVR pipeline end to end on the real stack: Ray, DeepSpeed, hf_infer, reward workers.

vLLM on a device of its own, with generation overlapped, is test_async_generation.py's run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.rlvr_runs import ONE_RANK, PARITY_REWARD, arithmetic_config, assert_zero_stage, block, run_rlvr

pytestmark = pytest.mark.slow

# Four steps, a checkpoint every two, with a reward that varies even for an untrained model (non-zero losses).
FOUR_STEPS = ("max_steps=4", "eval_steps=4", "save_steps=2", PARITY_REWARD)


@pytest.fixture(scope="module")
def four_steps(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A FOUR_STEPS run (shared by the tests below): its output directory and its metrics rows."""
    output = tmp_path_factory.mktemp("four_steps")
    return output, run_rlvr(arithmetic_config(output, *FOUR_STEPS))


def test_run_logs_metrics_plots_and_checkpoints_and_resumes_with_the_same_metrics(
    four_steps: tuple[Path, list[dict]],
) -> None:
    output, uninterrupted = four_steps
    assert [row["step"] for row in uninterrupted] == [0, 1, 2, 3, 4]
    for key in ("rollout/score_mean", "actor/loss", "actor/kl", "actor/grad_norm", "time/generate_s"):
        assert key in uninterrupted[2], key
    assert uninterrupted[2]["sync/colocated_bytes"] > 0 and uninterrupted[2]["sync/broadcast_bytes"] == 0
    assert uninterrupted[4]["val/accuracy"] >= 0 and uninterrupted[1]["rollout/response_length_mean"] > 0
    logs = output / "rlvr" / "logs"
    assert list((logs / "tensorboard").glob("events.out.tfevents.*"))
    assert {p.name for p in logs.glob("*.png")} >= {"reward.png", "accuracy.png", "kl.png", "response_length.png"}
    for step in (2, 4):
        assert (output / "rlvr" / "checkpoints" / f"step_{step}" / "driver_state.json").is_file()
    summary = json.loads((output / "rlvr" / "summary.json").read_text())
    assert set(summary) == {"val_accuracy_before", "val_accuracy_after"}

    # The same run again from its step-2 checkpoint: steps 3 and 4 are recomputed after a restart, and the rows
    # logged up to the checkpoint are kept as they were.
    resumed = run_rlvr(arithmetic_config(output, *FOUR_STEPS, "resume_from_checkpoint=step_2"))
    keys = ("rollout/score_mean", "rollout/response_length_mean", "actor/loss", "actor/kl", "actor/grad_norm")
    assert [row["step"] for row in resumed] == [row["step"] for row in uninterrupted]
    assert resumed[:3] == uninterrupted[:3]
    for expected, actual in zip(uninterrupted[3:], resumed[3:], strict=True):
        for key in keys:
            assert actual[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), (expected["step"], key)


def test_one_optimizer_step_takes_old_log_probs_from_the_update(
    four_steps: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    """FAST's rollout is one optimizer step of one epoch: no separate old log-probs pass, the same update.

    Against `old_log_probs_pass=always` with the reference on a device of its own (its pass and actor_train's
    then run at the same time), the first step, on the same samples, has the same loss and gradient norm.
    """
    _, skipped = four_steps
    separate = run_rlvr(
        arithmetic_config(
            tmp_path,
            *FOUR_STEPS,
            "max_steps=1",
            "devices_per_node=3",
            "reference.device_mapping=2",
            "algorithm.old_log_probs_pass=always",
        )
    )
    for row in skipped[1:]:
        assert "time/old_log_probs_s" not in row and "time/reference_log_probs_s" in row
        assert row["actor/ratio_mean"] == pytest.approx(1.0) and row["actor/clipfrac"] == 0.0
        assert row["actor/kl"] >= 0 and row["actor/kl_coef"] == 0.0 and row["actor/grad_norm"] > 0
    assert "time/reference_and_old_log_probs_s" in separate[1] and "time/old_log_probs_s" not in separate[1]
    for key in ("rollout/score_mean", "actor/loss", "actor/grad_norm", "actor/kl", "actor/kl_loss"):
        assert skipped[1][key] == pytest.approx(separate[1][key], rel=1e-5, abs=1e-7), key


# deepspeed_zero2 is the YAML's own block: FOUR_STEPS runs it. Each test below trains actor_train on another block,
# swapped by the same override a user writes (plain ZeRO-3 trains the GAE test's critic; ZeRO-2 with CPU offload
# is test_async_generation.py's); the offload blocks change what moves between phases.
def test_crashing_and_hanging_reward_function_does_not_stop_the_run(ray_session: None, tmp_path: Path) -> None:
    # With DAPO's refill on: rounds of generation and scoring (each with failing rewards) within the step.
    config = arithmetic_config(
        tmp_path,
        *ONE_RANK,
        "max_steps=1",
        "eval_steps=100",
        "eval_batch_size=8",
        "rewards.math.reward_fn=tests.reward_functions.flaky_reward",
        "rewards.math.timeout_s=2",
        "algorithm.dynamic_sampling=true",
        "algorithm.dynamic_sampling_max_rounds=2",
        block("deepspeed_zero3_cpuoffload"),
    )
    assert_zero_stage(config, 3)
    rows = run_rlvr(config)
    failed = sum(row.get("rollout/reward_failed", 0) for row in rows)
    assert [row["step"] for row in rows][-1] == 1
    assert failed > 0  # samples whose answers end in 3 or 7 scored 0 and were counted
    step = rows[-1]
    # A second round runs unless the first filled the batch; what is kept is whole optimizer steps (32 rows).
    rounds = step["rollout/generation_rounds"]
    assert rounds in (1.0, 2.0)
    assert rounds == 2.0 or step["rollout/informative_groups"] >= 8
    assert round(step["rollout/kept_fraction"] * 32 * rounds) in (0, 32)


def test_gae_with_a_critic_trains_both_roles(ray_session: None, tmp_path: Path) -> None:
    critic = (
        "critic={worker_cls: roll.pipeline.base.rl_workers.CriticWorker, device_mapping: 0, "
        "model_args: {model_name_or_path: 'tiny://qwen2', dtype: fp32}, "
        "strategy_args: {strategy_name: deepspeed_train, strategy_config: '${deepspeed_zero3}'}, "
        "training_args: {per_device_train_batch_size: 32, gradient_accumulation_steps: 1, learning_rate: 1.0e-4}}"
    )
    config = arithmetic_config(
        tmp_path,
        *ONE_RANK,
        critic,
        "max_steps=2",
        "eval_batch_size=4",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_loss=false",
        PARITY_REWARD,
        block("deepspeed_zero"),
    )
    assert_zero_stage(config, 0)
    rows = run_rlvr(config)
    assert rows[-1]["step"] == 2
    for key in ("critic/loss", "critic/grad_norm", "critic/clipfrac", "actor/loss", "time/values_s"):
        assert key in rows[-1], key
    assert rows[-1]["critic/grad_norm"] > 0 and rows[-1]["actor/grad_norm"] > 0


def test_a_pipeline_whose_role_cannot_start_releases_what_it_reserved(ray_session: None, tmp_path: Path) -> None:
    import ray

    from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline
    from tests.conftest import held_resources

    config = arithmetic_config(
        tmp_path, *ONE_RANK, "actor_train.worker_cls=tests.pipeline_workers.UnbuildableActorWorker"
    )
    with pytest.raises(ray.exceptions.RayTaskError, match=r"no file named model\.safetensors"):
        RLVRPipeline(config)
    # No pipeline was returned to shut down: the constructor released the devices and the processes itself.
    deadline = time.monotonic() + 30
    while held_resources() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not held_resources()
