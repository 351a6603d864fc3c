"""Reward functions in a child process: scores, failures, deadlines and a quiet exit however Ray ends the worker."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from roll.rewards.reward_process import RewardFunctionError, Scorer
from tests.conftest import REPO_ROOT

HERE = "tests.unit.test_reward_process"


def picky_reward(prompt: str, response: str, answer: str) -> float:
    """Scores like exact match, raises on 'raise', hangs on 'hang', kills its process on 'exit'."""
    if response == "raise":
        raise ValueError("cannot parse")
    if response == "hang":
        time.sleep(60)
    if response == "exit":
        os._exit(3)
    return float(response == answer)


@pytest.fixture
def scorer() -> Iterator[Scorer]:
    scorer = Scorer(multiprocessing.get_context("forkserver"), f"{HERE}.picky_reward")
    yield scorer
    scorer.close()


def test_scores_and_failures(scorer: Scorer) -> None:
    first, raised, wrong = scorer.score_all([("1+1=", "2", "2"), ("1+1=", "raise", "2"), ("1+1=", "3", "2")], 30)
    assert (first, wrong) == (1.0, 0.0)
    assert isinstance(raised, RewardFunctionError) and "picky_reward: ValueError: cannot parse" in str(raised)


def test_a_hung_or_dead_child_fails_its_sample_and_the_rest_of_the_batch_is_scored(scorer: Scorer) -> None:
    started = time.monotonic()
    batch = [("", "a", "a"), ("", "hang", ""), ("", "b", "b"), ("", "exit", ""), ("", "c", "x"), ("", "d", "d")]
    outcomes = scorer.score_all(batch, timeout_s=1)
    assert time.monotonic() - started < 30
    assert outcomes[0] == 1.0 and outcomes[2] == 1.0 and outcomes[4:] == [0.0, 1.0]
    assert isinstance(outcomes[1], TimeoutError) and "took longer than 1 s" in str(outcomes[1])
    assert isinstance(outcomes[3], RewardFunctionError)
    assert "the scoring process died (exit code 3)" in str(outcomes[3])
    assert scorer.score_all([("", "a", "a")], timeout_s=30) == [1.0]


def test_importing_the_functions_is_not_a_samples_time() -> None:
    scorer = Scorer(multiprocessing.get_context("forkserver"), "tests.unit.slow_reward_module.exact")
    try:
        assert scorer.score_all([("", "a", "a"), ("", "b", "c")], timeout_s=0.5) == [1.0, 0.0]
    finally:
        scorer.close()


def test_a_child_that_died_between_batches_is_replaced_without_failing_a_sample(scorer: Scorer) -> None:
    assert scorer.score_all([("", "a", "a")], timeout_s=30) == [1.0]
    scorer._process.kill()
    scorer._process.join()
    assert scorer.score_all([("", "a", "a"), ("", "b", "c")], timeout_s=30) == [1.0, 0.0]


# What a reward worker does, then what Ray does when the worker ends: kill the worker's child processes
# (multiprocessing's resource tracker among them) before the worker's own Python exits.
WORKER_EXIT = f"""
import multiprocessing, os, signal
from multiprocessing import resource_tracker
from roll.rewards.reward_process import Scorer

scorer = Scorer(multiprocessing.get_context("forkserver"), "{HERE}.picky_reward")
print(scorer.score_all([("", "a", "a")], timeout_s=30)[0])
scorer.close()
if resource_tracker._resource_tracker._pid is not None:
    os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
"""


def test_worker_exit_after_ray_killed_its_children_is_quiet() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WORKER_EXIT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "1.0", done.stderr
    # A multiprocessing.Pool here printed one `KeyError: '/mp-...'` traceback per semaphore (six).
    assert "Traceback" not in done.stderr and "KeyError" not in done.stderr, done.stderr
