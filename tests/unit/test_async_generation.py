"""Generation overlapped with training: the config's device and TIS rules, the policy-version bookkeeping, and
the driver's schedule (which generation runs with which weights, and when the weights are synced)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.residency import Residency
from roll.pipeline.rlvr.async_generation import POLICY_VERSION, InFlightRollout, PolicyVersions, save_in_flight
from roll.pipeline.rlvr.rlvr_pipeline import IN_FLIGHT, RLVRPipeline
from tests.unit.test_config_validation import rlvr

# actor_train and the reference on device 0, actor_infer on device 1 of the 2 on this machine.
OWN_DEVICE = [
    "actor_train.device_mapping=0",
    "reference.device_mapping=0",
    "actor_infer.device_mapping=1",
    "algorithm.tis_cap=2.0",
]

# ---- config ----------------------------------------------------------------------------------


def test_default_is_synchronous_and_k_with_actor_infer_on_its_own_device_loads() -> None:
    assert rlvr().async_generation_ratio == 0
    config = rlvr("async_generation_ratio=1", *OWN_DEVICE)
    assert config.async_generation_ratio == 1
    assert config.actor_infer.devices == [1] and config.actor_train.devices == config.reference.devices == [0]


def test_overlapping_roles_sharing_actor_infer_devices_is_a_config_error() -> None:
    """The default recipe colocates every role on devices 0-1: the error names the role, devices and the fix."""
    with pytest.raises(
        ConfigError, match=r"async_generation_ratio=1 .* actor_train .* \[0, 1\]; set actor_infer\.device_mapping"
    ):
        rlvr("async_generation_ratio=1", "algorithm.tis_cap=2.0")
    with pytest.raises(
        ConfigError, match=r"while reference works, but both use device\(s\) \[1\].*fewer devices"
    ) as error:
        rlvr("async_generation_ratio=1", *OWN_DEVICE, "reference.device_mapping=1")
    assert "\n" not in str(error.value)
    # A configured reference the algorithm does not use runs nothing, so it may stay on actor_infer's device.
    rlvr("async_generation_ratio=1", *OWN_DEVICE, "reference.device_mapping=1", "algorithm.use_kl_loss=false")


def test_overlap_suggests_the_free_devices() -> None:
    overrides = ["devices_per_node=3", "actor_train.device_mapping=0-1", "reference.device_mapping=0-1"]
    with pytest.raises(ConfigError, match=r"e\.g\. actor_infer\.device_mapping=\[2\]"):
        rlvr("async_generation_ratio=1", "algorithm.tis_cap=2.0", *overrides)


def test_overlap_needs_the_tis_correction() -> None:
    with pytest.raises(ConfigError, match=r"async_generation_ratio=2 .* set algorithm\.tis_cap"):
        rlvr("async_generation_ratio=2", *OWN_DEVICE[:3])


def test_negative_ratio_is_rejected() -> None:
    with pytest.raises(ConfigError, match="async_generation_ratio"):
        rlvr("async_generation_ratio=-1")


# ---- bookkeeping -----------------------------------------------------------------------------


def batch_of(rows: int, version: int) -> DataProto:
    batch = DataProto.from_dict(tensors={"responses": torch.zeros(rows, 2)})
    batch.non_tensor_batch[POLICY_VERSION] = np.full(rows, version)
    return batch


def test_staleness_is_updates_since_the_sampling_weights_and_bounded() -> None:
    versions = PolicyVersions(max_staleness=1)
    assert versions.staleness_metrics(batch_of(4, 0)) == {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    versions.updated()
    assert versions.served == 0
    assert versions.staleness_metrics(batch_of(4, 0))["rollout/staleness_max"] == 1.0
    versions.synced()
    assert versions.served == 1
    versions.updated()
    mixed = DataProto.concat([batch_of(1, 1), batch_of(3, 2)])
    assert versions.staleness_metrics(mixed) == {"rollout/staleness_mean": 0.25, "rollout/staleness_max": 1.0}
    with pytest.raises(RuntimeError, match=r"2 policy versions ago .* async_generation_ratio=1"):
        versions.staleness_metrics(batch_of(2, 0))


def test_in_flight_rollout_tags_its_rows_with_its_version_once() -> None:
    future = FakeFuture(DataProto.from_dict(tensors={"responses": torch.zeros(3, 2)}))
    rollout = InFlightRollout(step=2, future=future, version=5)
    assert rollout.result().non_tensor_batch[POLICY_VERSION].tolist() == [5, 5, 5]
    assert rollout.result() is rollout.result() and future.gets == 1


# ---- the driver's schedule -------------------------------------------------------------------


@dataclass(eq=False)
class FakeFuture:
    value: DataProto
    on_get: list = field(default_factory=list)
    gets: int = 0

    def get(self) -> DataProto:
        self.gets += 1
        for callback in self.on_get:
            callback(self)
        return self.value


class FakeInfer:
    """actor_infer: logs each generate (by its seed) and which calls are still running."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.running = log, set()

    def generate(self, prompts: DataProto, args: GeneratingArguments, blocking: bool = True) -> object:
        self.log.append(f"generate {args.seed}" + ("" if blocking else " async"))
        result = DataProto.from_dict(tensors={"responses": torch.zeros(len(prompts) * args.num_return_sequences, 2)})
        if blocking:
            return result
        future = FakeFuture(result, on_get=[self.running.discard])
        self.running.add(future)
        return future


class FakeSampler:
    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> list[SimpleNamespace]:
        self.position += 2
        example = SimpleNamespace(prompt_ids=[1, 2], prompt="1+1=", answer="2", domain="math", pixel_values=None)
        return [example] * 2

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}


def fake_pipeline(k: int, max_steps: int, log: list[str]) -> RLVRPipeline:
    """An RLVRPipeline with what `_rollout` reads: a fake actor_infer, weight syncer and sampler."""
    pipeline = RLVRPipeline.__new__(RLVRPipeline)
    infer = FakeInfer(log)

    def sync() -> dict[str, float]:
        assert not infer.running, "a weight sync while actor_infer generates"
        log.append("sync")
        return {"sync/seconds": 0.0}

    pipeline.config = SimpleNamespace(
        async_generation_ratio=k,
        max_steps=max_steps,
        seed=100,
        algorithm=SimpleNamespace(tis_cap=2.0),
        actor_infer=SimpleNamespace(generating_args=GeneratingArguments(num_return_sequences=2, max_new_tokens=2)),
    )
    pipeline.clusters = {"actor_infer": infer}
    pipeline.residency = Residency(pipeline.clusters, {})
    pipeline.weight_syncer = SimpleNamespace(sync=sync)
    pipeline.sampler, pipeline.pad_id, pipeline.log_prob_temperature = FakeSampler(), 0, 1.0
    pipeline.weights_stale, pipeline.versions, pipeline.in_flight = False, PolicyVersions(k), None
    pipeline.env_rollouts = None
    return pipeline


def run_steps(pipeline: RLVRPipeline, steps: int, first: int = 1) -> list[dict[str, float]]:
    """`_rollout` of each step from `first` to `steps`, then an actor update as `step` makes it."""
    all_metrics = []
    for step in range(first, steps + 1):
        metrics: dict[str, float] = {}
        batch = pipeline._rollout(step, metrics, {})
        assert len(batch) == 4
        pipeline.versions.updated()
        pipeline.weights_stale = True
        all_metrics.append(metrics)
    return all_metrics


def test_synchronous_schedule_syncs_then_generates_and_waits() -> None:
    log: list[str] = []
    pipeline = fake_pipeline(0, max_steps=3, log=log)
    metrics = run_steps(pipeline, 3)
    assert log == ["generate 101", "sync", "generate 102", "sync", "generate 103"]
    assert pipeline.in_flight is None
    assert not any("staleness" in key for m in metrics for key in m)


def test_overlapped_schedule_generates_the_next_batch_before_training_and_syncs_when_idle() -> None:
    """k=1: step t's batch was started during step t-1 by weights one update old; the last step starts none."""
    log: list[str] = []
    pipeline = fake_pipeline(1, max_steps=4, log=log)
    metrics = run_steps(pipeline, 4)
    assert log == [
        "generate 101 async",
        "generate 102 async",
        "sync",
        "generate 103 async",
        "sync",
        "generate 104 async",
        "sync",
    ]
    assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert pipeline.in_flight is None


def test_in_flight_rollout_keeps_the_sampler_state_before_its_prompts() -> None:
    pipeline = fake_pipeline(1, max_steps=4, log=[])
    pipeline._rollout(1, {}, {})
    assert pipeline.sampler.position == 4  # step 1's prompts and step 2's, in flight
    assert pipeline.in_flight is not None and pipeline.in_flight.step == 2


def test_a_checkpoint_with_a_batch_in_flight_resumes_the_uninterrupted_schedule(tmp_path: Path) -> None:
    """k=1, saved after step 2 with step 3's batch in flight: the resumed run trains on that very batch (no
    generate of seed 103 again), with the staleness and the generate/sync order of the uninterrupted run."""
    uninterrupted_log: list[str] = []
    uninterrupted = run_steps(fake_pipeline(1, max_steps=4, log=uninterrupted_log), 4)
    log: list[str] = []
    before = fake_pipeline(1, max_steps=4, log=log)
    metrics = run_steps(before, 2)
    assert before.in_flight is not None
    state = {
        "policy_versions": {"trained": before.versions.trained, "served": before.versions.served},
        IN_FLIGHT: save_in_flight(before.in_flight, tmp_path),
    }
    after = fake_pipeline(1, max_steps=4, log=log)
    after.weights_stale = True  # as `resume` leaves it: actor_infer must get the checkpoint's weights
    after.restore_schedule(tmp_path, state)
    metrics += run_steps(after, 4, first=3)
    assert log == uninterrupted_log
    staleness = ("rollout/staleness_mean", "rollout/staleness_max")
    assert [[m[key] for key in staleness] for m in metrics] == [[m[key] for key in staleness] for m in uninterrupted]
