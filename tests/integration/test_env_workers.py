"""The env role on a real Ray: the multi-turn rollout gives the same batch with its environments in actors as in
the driver, slots spread over actors answer as the driver's manager does, and a lost actor ends only its own slots'
episodes and is replaced at the next reset. One rollout's env workers serve every test (two actor starts)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.envs.manager import EnvManager
from roll.envs.protocol import ENV_ERROR
from roll.envs.registry import make_env
from roll.models.model_providers import load_tokenizer
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.env_workers import EnvWorkers
from roll.pipeline.agentic.multi_turn import MultiTurnRollout
from tests.unit.test_multi_turn import ScriptedEngine

# One shared rollout (two env-worker actors, the driver's twin) costs 30-70 s on 2 cores: slow, by the tiers' rule.
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]

# A dotted path: the actors import it themselves (a name registered in this process is unknown to them).
GUESS = "roll.envs.builtin.guess_number.GuessNumberEnv"
# Five episodes: the rollout's env workers hold five slots, 0-2 on actor 0 and 3-4 on actor 1.
SEEDS = [1, 2, 3, 4, 5]

Played = tuple[DataProto, dict[str, float]]


@pytest.fixture(scope="module")
def rollouts() -> Iterator[tuple[Played, Played, EnvWorkers]]:
    """The same episodes played with the environments in the driver and in two env workers; the rollout's
    EnvWorkers stay up for the other tests and are closed after the module."""
    tokenizer = load_tokenizer("tiny://qwen2")
    args = GeneratingArguments(max_new_tokens=4)
    played: list[Played] = []
    rollouts: list[MultiTurnRollout] = []
    try:
        for count in (0, 2):
            env = EnvArguments(
                name=GUESS, kwargs={"n": 16}, num_env_workers=count, timeout_s=5, max_trajectory_tokens=32
            )
            rollouts.append(rollout := MultiTurnRollout(env, tokenizer, pad_id=0))
            played.append(rollout.run(ScriptedEngine(tokenizer).generate, SEEDS, args, base_seed=0))
        (workers,) = rollouts[1]._managers.values()
        assert isinstance(workers, EnvWorkers) and workers.num_envs == len(SEEDS)
        yield played[0], played[1], workers
    finally:
        for rollout in rollouts:
            rollout.close()


def test_the_rollout_gives_the_same_batch_with_env_workers(rollouts: tuple[Played, Played, EnvWorkers]) -> None:
    (driver, driver_metrics), (actors, actor_metrics), _ = rollouts
    assert driver_metrics == actor_metrics
    for key in ("responses", "response_mask", "turn_rewards", "scores"):
        assert driver.batch[key].equal(actors.batch[key]), key


def test_slots_spread_over_actors_answer_as_the_driver_does(rollouts: tuple[Played, Played, EnvWorkers]) -> None:
    workers = rollouts[2]
    local = EnvManager(lambda: make_env(GUESS, {"n": 16}), num_envs=5)
    try:
        seeds, slots = [3, 1, 4, 1, 5], [4, 0, 2, 1, 3]  # slots out of order, across both actors' blocks
        assert workers.reset(seeds, slots) == local.reset(seeds, slots)
        actions = ["8", "4", "12", "2", "16"]
        assert workers.step(actions, slots) == local.step(actions, slots)
        assert workers.step(["1"], [2]) == local.step(["1"], [2])  # one actor only
    finally:
        local.close()


def test_a_lost_actor_truncates_its_own_slots_and_is_replaced(rollouts: tuple[Played, Played, EnvWorkers]) -> None:
    workers = rollouts[2]  # slots 0-2 on actor 0, 3-4 on actor 1
    workers.reset([1, 2, 5, 3, 4])  # no target 8 on actor 0: its slots go on
    ray.kill(workers._actors[1])
    results = workers.step(["8"] * 5)
    assert [r.info.get(ENV_ERROR, 0) for r in results] == [0, 0, 0, 1, 1]
    assert all(r.truncated for r in results[3:]) and not any(r.done for r in results[:3])
    again = workers.reset([5, 6, 7, 8, 9])  # actor 1 is started anew
    assert [r.observation for r in again] == ["guess 1-16"] * 5
    assert not any(r.info.get(ENV_ERROR) for r in workers.step(["8"] * 5))
