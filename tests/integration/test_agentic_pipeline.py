"""The agentic guess_number recipe end to end with real Ray, DeepSpeed and hf_infer: two steps of multi-turn
episodes, their metrics, a checkpoint, and a resume that recomputes the second step the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll.pipeline.rlvr.async_generation import IN_FLIGHT_FILE
from tests.rlvr_runs import run_rlvr, small_policy_config

pytestmark = pytest.mark.slow

# Two steps of 4 seeds x 4 episodes, 8 held-out episodes.
TWO_STEPS = ("max_steps=2", "eval_steps=2", "env.eval_episodes=8")


def run(output: Path, *overrides: str) -> list[dict]:
    """A TWO_STEPS run of agentic_guess_number.yaml writing under `output`, then `overrides`; its metrics rows."""
    return run_rlvr(small_policy_config("agentic_guess_number", output, *TWO_STEPS, *overrides))


def test_two_steps_of_episodes_train_checkpoint_and_resume(ray_session: None, tmp_path: Path) -> None:
    rows = run(tmp_path, "save_steps=1")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for step in (1, 2):
        row = rows[step]
        for key in ("rollout/success", "rollout/turns_mean", "rollout/invalid_action_rate", "actor/loss"):
            assert key in row, (step, key)
        assert 1 <= row["rollout/turns_mean"] <= 5 and row["rollout/env_errors"] == 0
    assert 0 <= rows[2]["val/accuracy"] <= 1 and 0 <= rows[2]["val/sampled_success"] <= 1
    run_dir = tmp_path / "agentic_guess_number"
    assert (run_dir / "checkpoints" / "step_1" / "driver_state.json").is_file()

    # The episodes of step 2 again after a restart: the same seeds, played with the same sampling seed.
    resumed = run(tmp_path, "save_steps=1", "resume_from_checkpoint=step_1")
    assert [row["step"] for row in resumed] == [0, 1, 2]
    for key in ("rollout/success", "rollout/turns_mean", "rollout/response_length_mean", "actor/loss"):
        assert resumed[2][key] == pytest.approx(rows[2][key], rel=1e-6, abs=1e-9), key


# Three sources instead of env.name: guess_number as the recipe has it, the calculator (its episodes end after two
# answers), and an agent written with the openai client (tests/agents.py) answering `task <seed>` in two calls
# through roll's endpoint. Weighted 1:1:2, each step's 4 seeds (0-3, 4-7, 8-11) draw these groups of 4; the 8
# held-out seeds draw all three.
MIXED = (
    "~env.kwargs",
    "++env.sources=[{name: guess, env: guess_number, kwargs: {n: 16, max_turns: 5}}, "
    "{name: calc, env: calculator_arithmetic, kwargs: {min_digits: 2, max_digits: 2, max_turns: 2}}, "
    "{name: agent, env: tests.agents.EchoTask, agent: tests.agents.extending_agent, weight: 2}]",
)
GROUPS = ({"agent": 3, "guess": 1}, {"agent": 2, "guess": 1, "calc": 1}, {"agent": 1, "calc": 2, "guess": 1})


@pytest.fixture(scope="module")
def overlapped_on_vllm(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Three steps whose episodes vLLM (on a device slot of its own) plays during the previous update, the
    environments of three sources (guess_number, the calculator and an agent's, `MIXED`) in an env-worker actor
    each (the agent's calls through the endpoint, backed by vLLM), with the TIS correction and a checkpoint after
    each step: the output directory and metrics rows of one run for the tests below."""
    output = tmp_path_factory.mktemp("overlapped_on_vllm")
    return output, run(
        output,
        "max_steps=3",
        "eval_steps=3",
        "devices_per_node=2",
        "actor_infer.device_mapping=1",
        "actor_infer.strategy_args.strategy_name=vllm",
        "async_generation_ratio=1",
        "algorithm.tis_cap=2.0",
        "env.num_env_workers=1",  # one actor per source: three env-worker processes in all
        "save_steps=1",
        *MIXED,
    )


def test_episodes_played_during_the_previous_update_by_env_workers(overlapped_on_vllm: tuple[Path, list[dict]]) -> None:
    """async_generation_ratio=1 with env: each step's episodes are played (in a driver thread, the environments
    in two env-worker actors) while the previous step trains, by weights at most one version old."""
    output, rows = overlapped_on_vllm
    steps = rows[1:]
    assert [row["rollout/staleness_max"] for row in steps] == [0.0, 1.0, 1.0]
    for row in steps:
        assert 1 <= row["rollout/turns_mean"] <= 5 and row["rollout/env_errors"] == 0
        assert 0 < row["actor/tis_weight_mean"] <= 2.0
    assert 0 <= rows[-1]["val/accuracy"] <= 1
    # Step 2's episodes were in flight when step 1 saved: the checkpoint waited for them and stores their batch, so
    # the sampler's position is past their seeds (two batches of 4) and a resumed run trains on that batch.
    checkpoint = output / "agentic_guess_number" / "checkpoints" / "step_1"
    state = json.loads((checkpoint / "driver_state.json").read_text())
    assert state["step"] == 1 and state["sampler"] == {"position": 8}
    assert (checkpoint / IN_FLIGHT_FILE).is_file()


def test_each_source_plays_in_env_workers_of_its_own_with_metrics_per_source(
    overlapped_on_vllm: tuple[Path, list[dict]],
) -> None:
    """env.sources: each episode plays its seed's source, built with that source's kwargs in the env workers (the
    agent's episodes run by the agent in its source's worker, its calls answered by vLLM through the endpoint);
    the rollout and held-out metrics come per source, and the overall ones are over all of them."""
    rows = overlapped_on_vllm[1]
    for row, groups in zip(rows[1:], GROUPS, strict=True):
        for source in groups:
            assert row[f"rollout/{source}/env_errors"] == 0, source
        assert row["rollout/agent/agent_calls_per_episode"] == 2 and row["rollout/agent/agent_new_segments"] == 0
        if "calc" in groups:
            assert 1 <= row["rollout/calc/turns_mean"] <= 2
        assert 1 <= row["rollout/guess/turns_mean"] <= 5
        mean = sum(count * 4 * row[f"rollout/{source}/turns_mean"] for source, count in groups.items()) / 16
        assert row["rollout/turns_mean"] == pytest.approx(mean)
    for key in ("accuracy", "sampled_success"):
        for source in ("calc", "guess", "agent"):
            assert 0 <= rows[-1][f"val/{source}/{key}"] <= 1, source


def test_vllm_plays_the_episodes_token_in_token_out(overlapped_on_vllm: tuple[Path, list[dict]]) -> None:
    """actor_infer on vLLM (CPU build) plays multi-turn episodes and answers the agent's calls: each turn or call is
    a generate call on the ids so far. With the TIS correction the engine reports its log-probs of the sampled
    tokens; the trainer's recomputed log-probs of the same ids agree with them, so the ids trained on are the ids
    vLLM saw and sampled, the agent's included (step 1 is mostly the agent's)."""
    step = overlapped_on_vllm[1][1]
    assert 1 <= step["rollout/turns_mean"] <= 5 and step["rollout/env_errors"] == 0
    # Step 1's episodes were played by the weights it trains (staleness 0): the engine's and the trainer's
    # log-probs differ by numerics only.
    assert step["rollout/staleness_max"] == 0.0
    assert step["actor/tis_weight_mean"] == pytest.approx(1.0, abs=0.05)


def test_frozen_lake_trains_actor_and_critic_with_gae(ray_session: None, tmp_path: Path) -> None:
    """The frozen_lake recipe's GAE path: per-turn rewards and turn discounts reach a critic that trains."""
    config = small_policy_config(
        "agentic_frozen_lake",
        tmp_path,
        "max_steps=1",
        "eval_steps=1",
        "env.eval_episodes=8",
        "critic.device_mapping=0",
        "critic.training_args.per_device_train_batch_size=16",
        "critic.training_args.gradient_accumulation_steps=1",
    )
    step = run_rlvr(config)[1]
    assert step["critic/grad_norm"] > 0 and step["actor/grad_norm"] > 0
    assert 1 <= step["rollout/turns_mean"] <= 10 and step["rollout/env_errors"] == 0
