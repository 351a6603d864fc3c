"""Residency: which colocated roles a phase offloads and loads (pure logic, stand-in clusters)."""

from __future__ import annotations

from types import SimpleNamespace

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

    def offload_moves_states(self, blocking: bool = True) -> Done:
        return Done([True, True])


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


class HostMemoryCluster(RecordingCluster):
    """A role whose offload can move nothing here (e.g. DeepSpeed offloading to host memory on a CPU platform)."""

    def offload_moves_states(self, blocking: bool = True) -> Done:
        self.log.append(f"asked {self.name}")
        return Done([False, False])


def test_roles_whose_offload_moves_nothing_are_tracked_but_never_called() -> None:
    log: list[str] = []
    clusters = {
        "actor_train": RecordingCluster("actor_train", log),
        "actor_infer": HostMemoryCluster("actor_infer", log),
    }
    roles = {name: SimpleNamespace(devices=[0, 1]) for name in clusters}
    residency = Residency.of_roles(clusters, roles)  # type: ignore[arg-type]
    assert log == ["asked actor_infer"] and residency.unmoved == {"actor_infer"}

    log.clear()
    residency.enter(phases.GENERATE)
    residency.enter(phases.OLD_LOG_PROBS)
    residency.enter(phases.SYNC_WEIGHTS)
    assert log == ["offload actor_train", "load actor_train"]
    assert residency.resident == set(clusters)
