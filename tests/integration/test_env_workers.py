"""The env role on a real Ray: slots spread over actors answer as the driver's manager does, and a lost actor
ends only its own slots' episodes and is replaced at the next reset."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from roll.configs.worker_config import GeneratingArguments
from roll.envs.manager import EnvManager
from roll.envs.protocol import ENV_ERROR
from roll.envs.registry import make_env
from roll.models.model_providers import load_tokenizer
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.env_workers import EnvWorkers
from roll.pipeline.agentic.multi_turn import MultiTurnRollout
from tests.unit.test_multi_turn import ScriptedEngine

pytestmark = pytest.mark.usefixtures("ray_session")

# A dotted path: the actors import it themselves (a name registered in this process is unknown to them).
GUESS = "roll.envs.builtin.guess_number.GuessNumberEnv"


def _env(**fields: Any) -> EnvArguments:
    return EnvArguments(name=GUESS, kwargs={"n": 16}, num_env_workers=2, timeout_s=5, **fields)


def test_slots_spread_over_actors_answer_as_the_driver_does() -> None:
    env = _env()
    workers = EnvWorkers(env, num_envs=5)
    local = EnvManager(lambda: make_env(GUESS, {"n": 16}), num_envs=5)
    try:
        seeds, slots = [3, 1, 4, 1, 5], [4, 0, 2, 1, 3]  # slots out of order, across both actors' blocks
        assert workers.reset(seeds, slots) == local.reset(seeds, slots)
        actions = ["8", "4", "12", "2", "16"]
        assert workers.step(actions, slots) == local.step(actions, slots)
        assert workers.step(["1"], [2]) == local.step(["1"], [2])  # one actor only
    finally:
        workers.close()


def test_a_lost_actor_truncates_its_own_slots_and_is_replaced() -> None:
    workers = EnvWorkers(_env(), num_envs=4)  # slots 0-1 on actor 0, 2-3 on actor 1
    try:
        workers.reset([1, 2, 3, 4])
        ray.kill(workers._actors[1])
        results = workers.step(["8"] * 4)
        assert [r.info.get(ENV_ERROR, 0) for r in results] == [0, 0, 1, 1]
        assert all(r.truncated for r in results[2:]) and not any(r.done for r in results[:2])
        again = workers.reset([5, 6, 7, 8])  # actor 1 is started anew
        assert [r.observation for r in again] == ["guess 1-16"] * 4
        assert not any(r.info.get(ENV_ERROR) for r in workers.step(["8"] * 4))
    finally:
        workers.close()


def test_the_rollout_gives_the_same_batch_with_env_workers() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    args = GeneratingArguments(max_new_tokens=4)
    batches = []
    for count in (0, 2):
        env = EnvArguments(name=GUESS, kwargs={"n": 16}, num_env_workers=count, max_trajectory_tokens=32)
        rollout = MultiTurnRollout(env, tokenizer, pad_id=0)
        try:
            batch, metrics = rollout.run(ScriptedEngine(tokenizer).generate, [1, 2, 3], args, base_seed=0)
        finally:
            rollout.close()
        batches.append((batch, metrics))
    (driver, driver_metrics), (actors, actor_metrics) = batches
    assert driver_metrics == actor_metrics
    for key in ("responses", "response_mask", "turn_rewards", "scores"):
        assert driver.batch[key].equal(actors.batch[key]), key
