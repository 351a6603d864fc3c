"""Residency: which colocated roles a phase offloads and loads (pure logic, stand-in clusters)."""

from __future__ import annotations

from roll.pipeline.base.residency import Residency
from roll.pipeline.rlvr import phases


class Done:
    def __init__(self, value: list[dict[str, float]]) -> None:
        self.value = value

    def get(self) -> list[dict[str, float]]:
        return self.value


class RecordingCluster:
    """Answers offload/load like a cluster of two ranks that each move 10 bytes."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def offload_states(self, blocking: bool = True) -> Done:
        self.log.append(f"offload {self.name}")
        return Done([{"x/offload/moved_bytes/model_params": 10.0, "x/offload/seconds": 1.0}] * 2)

    def load_states(self, blocking: bool = True) -> Done:
        self.log.append(f"load {self.name}")
        return Done([{"x/offload/moved_bytes/model_params": 10.0, "x/offload/seconds": 1.0}] * 2)


def test_colocated_roles_take_turns_and_separate_roles_stay() -> None:
    log: list[str] = []
    names = ("actor_train", "actor_infer", "reference", "rewards.math")
    clusters = {name: RecordingCluster(name, log) for name in names}
    devices = {"actor_train": [0, 1], "actor_infer": [0, 1], "reference": [2, 3], "rewards.math": []}
    residency = Residency(clusters, devices)  # type: ignore[arg-type]

    metrics = residency.enter(phases.GENERATE)
    assert log == ["offload actor_train"]  # the reference has devices of its own; rewards none
    assert metrics["phase/generate/bytes_moved"] == 20.0

    log.clear()
    residency.enter(phases.OLD_LOG_PROBS)
    assert log == ["offload actor_infer", "load actor_train"]

    log.clear()
    residency.enter(phases.OLD_LOG_PROBS)
    residency.enter(phases.REWARDS)
    assert log == []  # already resident; a phase that needs no role moves nothing

    residency.enter(phases.SYNC_WEIGHTS)
    assert log == ["load actor_infer"] and residency.resident == set(names)
