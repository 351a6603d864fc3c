"""The env manager: a raising, hanging or garbage-returning environment ends its own episode, never the batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest

from roll.envs.deadline import run_with_deadline
from roll.envs.manager import EnvManager

TIMEOUT_S = 0.5
# Hanging calls wait on this; set at the end of each test so their abandoned threads finish.
release = threading.Event()


@pytest.fixture(autouse=True)
def release_hung_threads() -> Iterator[None]:
    release.clear()
    yield
    release.set()


class ScriptedEnv:
    """Behaves by the seed of its episode: 0 well, 1 raises in step, 2 hangs in step, 3 returns garbage in step,
    4 raises in reset, 5 hangs in reset."""

    instances: ClassVar[list[ScriptedEnv]] = []

    def __init__(self) -> None:
        ScriptedEnv.instances.append(self)
        self.mode = 0
        self.closed = False

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.mode = seed or 0
        if self.mode == 4:
            raise RuntimeError("reset broke")
        if self.mode == 5:
            release.wait(30)
        return f"start {self.mode}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.mode == 1:
            raise KeyError("step broke")
        if self.mode == 2:
            release.wait(30)
        if self.mode == 3:
            return ("only", "three", "items")  # type: ignore[return-value]
        return f"echo {action}", 1.0, True, False, {"success": 1.0}

    def close(self) -> None:
        self.closed = True


def test_failing_environments_truncate_their_own_episode_within_the_timeout() -> None:
    manager = EnvManager(ScriptedEnv, num_envs=6, max_concurrency=6, timeout_s=TIMEOUT_S)
    start = time.monotonic()
    resets = manager.reset([0, 1, 2, 3, 4, 5])
    assert time.monotonic() - start < TIMEOUT_S + 1.0
    assert [r.observation for r in resets[:4]] == ["start 0", "start 1", "start 2", "start 3"]
    assert [(r.truncated, r.info["env_error"]) for r in resets[4:]] == [(True, 1), (True, 1)]
    assert "reset raised RuntimeError: reset broke" in resets[4].info["env_error_message"]
    assert resets[5].info["env_error_message"] == f"reset did not return within {TIMEOUT_S:g}s"

    start = time.monotonic()
    steps = manager.step(["a", "b", "c", "d"], slots=[0, 1, 2, 3])
    assert time.monotonic() - start < TIMEOUT_S + 1.0
    assert (steps[0].observation, steps[0].reward, steps[0].terminated, steps[0].info) == (
        "echo a",
        1.0,
        True,
        {"success": 1.0},
    )
    for result in steps[1:]:
        assert (result.observation, result.reward, result.terminated, result.truncated) == ("", 0.0, False, True)
        assert result.info["env_error"] == 1 and result.done
    assert "step raised KeyError: 'step broke'" in steps[1].info["env_error_message"]
    assert "did not return within" in steps[2].info["env_error_message"]
    assert "returned garbage: step must return" in steps[3].info["env_error_message"]
    assert manager.error_counts == {"raised": 2, "timeout": 2, "invalid_output": 1}


def test_a_failed_environment_is_discarded_and_its_slot_rebuilt() -> None:
    manager = EnvManager(ScriptedEnv, num_envs=2, max_concurrency=2, timeout_s=TIMEOUT_S)
    ScriptedEnv.instances.clear()
    manager.reset([0, 2])
    well, hung = sorted(ScriptedEnv.instances, key=lambda env: env.mode)
    manager.step(["a", "b"])
    with pytest.raises(ValueError, match=r"slots \[0, 1\] have no running episode"):
        manager.step(["a", "b"])  # slot 0 terminated, slot 1 was truncated
    assert manager.reset([0], slots=[1])[0].observation == "start 0"
    assert len(ScriptedEnv.instances) == 3  # slot 1 got a fresh environment
    assert manager.step(["z"], slots=[1])[0].observation == "echo z"
    manager.close()
    assert (well.closed, ScriptedEnv.instances[2].closed, hung.closed) == (True, True, True)


def test_a_failed_environment_is_closed_when_discarded() -> None:
    manager = EnvManager(ScriptedEnv, num_envs=4, max_concurrency=4, timeout_s=TIMEOUT_S)
    ScriptedEnv.instances.clear()
    manager.reset([1, 2, 4, 5])  # 4 raises and 5 hangs in the reset that built them
    manager.step(["a", "b"], slots=[0, 1])  # 1 raises and 2 hangs in step
    deadline = time.monotonic() + 2
    while not all(env.closed for env in ScriptedEnv.instances) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(env.mode for env in ScriptedEnv.instances if env.closed) == [1, 2, 4, 5]


def test_the_concurrency_cap_holds() -> None:
    running, most, lock = 0, 0, threading.Lock()

    def call() -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return 1

    assert [o.value for o in run_with_deadline([call] * 6, timeout_s=5, max_concurrency=2)] == [1] * 6
    assert most == 2


def test_the_deadline_starts_with_each_call_and_late_results_are_dropped() -> None:
    def late() -> str:
        time.sleep(0.3)  # past its 0.2 s deadline, while the next call still runs
        return "late"

    def quick() -> str:
        time.sleep(0.15)
        return "quick"

    outcomes = run_with_deadline([late, quick], timeout_s=0.2, max_concurrency=1)
    assert (outcomes[0].timed_out, outcomes[0].value) == (True, None)
    assert (outcomes[1].ok, outcomes[1].value) == (True, "quick")


def test_bad_slots_are_refused() -> None:
    manager = EnvManager(ScriptedEnv, num_envs=2, timeout_s=TIMEOUT_S)
    with pytest.raises(ValueError, match="distinct"):
        manager.reset([0, 0], slots=[1, 1])
    with pytest.raises(ValueError, match="distinct and in"):
        manager.reset([0], slots=[2])
