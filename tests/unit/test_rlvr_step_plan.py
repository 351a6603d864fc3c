"""The decisions of one RLVR step (which passes run, and how), the overlong penalty and filter, and the step's
log-prob passes and updates against stand-in clusters."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll.configs.algorithm_config import AlgorithmArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.residency import Residency
from roll.pipeline.rlvr import phases
from roll.pipeline.rlvr.async_generation import PolicyVersions
from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline
from roll.pipeline.rlvr.rollout import add_overlong_penalty, mask_truncated_responses
from roll.pipeline.rlvr.step_plan import (
    OLD_LOG_PROBS_PASS,
    REFERENCE_PASS,
    TEACHER_PASS,
    dynamic_sampling_row_multiple,
    log_prob_passes,
    needs_old_log_prob_pass,
    runs_concurrently,
)
from tests.unit.test_placement import role
from tests.unit.test_residency import Done, RecordingCluster
from tests.unit.test_rollout import _role

# actor_train: micro-batches of 2 x accumulation 2 x dp 2 = 8 rows per optimizer step.
ACTOR_TRAIN = _role(2, micro=2, accumulation=2)


def test_one_epoch_of_one_optimizer_step_without_kl_penalty_or_teacher_skips_the_pass() -> None:
    assert not needs_old_log_prob_pass(AlgorithmArguments(), ACTOR_TRAIN, 8)
    # A KL loss reads the reference's log-probs in the update, not the old ones before it.
    assert not needs_old_log_prob_pass(AlgorithmArguments(use_kl_loss=True, kl_loss_coef=0.1), ACTOR_TRAIN, 8)


@pytest.mark.parametrize(
    ("algorithm", "rows"),
    [
        (AlgorithmArguments(ppo_epochs=2), 8),  # the second epoch starts from updated weights
        (AlgorithmArguments(kl_penalty_coef=0.01), 8),  # the penalty reads them in the advantages
        (AlgorithmArguments(kl_penalty_coef=0.01, adaptive_kl_target=6.0), 8),
        (AlgorithmArguments(teacher_kl_coef=1.0), 8),  # the teacher's reward reads them in the advantages
        (AlgorithmArguments(), 16),  # two optimizer steps: the second starts from updated weights
        (AlgorithmArguments(), 4),  # dynamic sampling kept half an optimizer step
        (AlgorithmArguments(old_log_probs_pass="always"), 8),
    ],
)
def test_the_old_log_probs_pass_runs_whenever_the_update_cannot_take_them_itself(
    algorithm: AlgorithmArguments, rows: int
) -> None:
    assert needs_old_log_prob_pass(algorithm, ACTOR_TRAIN, rows)


def test_log_prob_passes_run_reference_then_teacher_then_old_log_probs() -> None:
    assert log_prob_passes({"actor_train"}, old_log_probs=False) == []
    assert log_prob_passes({"actor_train"}, old_log_probs=True) == [OLD_LOG_PROBS_PASS]
    every_role = {"teacher", "critic", "actor_train", "reference"}
    assert log_prob_passes(every_role, old_log_probs=False) == [REFERENCE_PASS, TEACHER_PASS]
    passes = log_prob_passes(every_role, old_log_probs=True)
    assert [(p.role, p.phase, p.key) for p in passes] == [
        ("reference", phases.REFERENCE_LOG_PROBS, "ref_log_probs"),
        ("teacher", phases.TEACHER_LOG_PROBS, "teacher_log_probs"),
        ("actor_train", phases.OLD_LOG_PROBS, "old_log_probs"),
    ]


def test_reference_and_old_log_probs_run_at_once_only_on_disjoint_devices() -> None:
    actor_train = role("actor_train", 4, device_mapping="0-1")
    apart = {"actor_train": actor_train, "reference": role("reference", 4, device_mapping="2-3")}
    sharing = {"actor_train": actor_train, "reference": role("reference", 4, device_mapping="1-2")}
    pair = [REFERENCE_PASS, OLD_LOG_PROBS_PASS]
    assert runs_concurrently(pair, apart)
    assert not runs_concurrently(pair, sharing)  # device 1 in both
    # Only that pair: one pass alone, or with the teacher's between them, runs in turn.
    assert not runs_concurrently([REFERENCE_PASS], apart)
    teacher = {**apart, "teacher": role("teacher", 4, device_mapping="3")}
    assert not runs_concurrently([REFERENCE_PASS, TEACHER_PASS, OLD_LOG_PROBS_PASS], teacher)


def test_dynamic_sampling_keeps_a_multiple_for_every_role_that_takes_the_batch() -> None:
    # actor_train 2 x 2 x dp 1 = 4 rows per optimizer step, critic 1 x 1 x dp 3 = 3, reference dp 2, teacher dp 5:
    # lcm(4, 3, 2, 5) = 60.
    roles = {"actor_train": _role(1, 2, 2), "critic": _role(3), "reference": _role(2), "teacher": _role(5)}
    assert dynamic_sampling_row_multiple(roles) == 60
    assert dynamic_sampling_row_multiple({"actor_train": _role(1, 2, 2)}) == 4


def test_overlong_penalty_is_added_to_the_scores() -> None:
    # max_new_tokens 4, buffer 2: lengths 1..4 exceed 4 - 2 = 2 tokens by 0, 0, 1, 2 of 2 -> penalty 0, 0, -0.5, -1.
    response_mask = (torch.arange(4) < torch.tensor([1, 2, 3, 4])[:, None]).long()
    batch = DataProto.from_dict(tensors={"response_mask": response_mask, "scores": torch.tensor([1, 0, 1, 1])})
    algorithm = AlgorithmArguments(overlong_buffer_len=2, overlong_penalty_factor=1.0)
    assert add_overlong_penalty(batch, 4, algorithm) == pytest.approx(-0.375)
    assert batch.batch["scores"].tolist() == [1.0, 0.0, 0.5, 0.0]
    assert batch.batch["verifier_scores"].tolist() == [1.0, 0.0, 1.0, 1.0]


def test_overlong_filter_masks_only_the_responses_the_engine_cut() -> None:
    # Row 1 was cut at max_new_tokens; row 2 is as long but ended on its own (EOS or a stop string).
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    truncated = torch.tensor([False, True, False, False])
    batch = DataProto.from_dict(tensors={"response_mask": response_mask, "truncated": truncated})
    assert mask_truncated_responses(batch) == 0.25
    assert batch.batch["response_mask"].tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]]


# --- the step's passes and updates, against stand-in clusters ---------------------------------------------------


class StepCluster(RecordingCluster):
    """A role that logs its offloads, loads, log-prob passes and train steps."""

    def compute_log_probs(self, batch: DataProto, blocking: bool = True) -> Any:
        self.log.append(f"{self.name} log-probs" + ("" if blocking else " (non-blocking)"))
        result = DataProto.from_dict(tensors={"log_probs": torch.zeros(len(batch), 1)})
        return result if blocking else Done(result)

    def train_step(self, batch: DataProto, algorithm: AlgorithmArguments) -> list[dict[str, float]]:
        self.log.append(f"{self.name} train {sorted(batch.batch.keys())}")
        return [{"loss": 0.5}]


def stand_in(roles: dict[str, Any], algorithm: AlgorithmArguments, log: list[str]) -> SimpleNamespace:
    """What the step's methods read of an RLVRPipeline, with `roles` as stand-in clusters on their devices."""
    clusters = {name: StepCluster(name, log) for name in roles}
    pipeline = SimpleNamespace(
        config=SimpleNamespace(algorithm=algorithm, actor_train=roles["actor_train"]),
        trainer_roles=roles,
        clusters=clusters,
        residency=Residency.of_roles(clusters, roles),  # type: ignore[arg-type]
        versions=PolicyVersions(0),
        weights_stale=False,
    )
    pipeline._trained_roles = partial(RLVRPipeline._trained_roles, pipeline)
    return pipeline


@pytest.mark.parametrize("reference_devices", ["2-3", "1-2"])
def test_reference_and_old_log_probs_are_issued_together_or_in_turn(reference_devices: str) -> None:
    log: list[str] = []
    roles = {
        "actor_train": role("actor_train", 4, device_mapping="0-1"),
        "reference": role("reference", 4, device_mapping=reference_devices),
    }
    pipeline = stand_in(roles, AlgorithmArguments(old_log_probs_pass="always"), log)
    timings: dict[str, float] = {}
    batch = RLVRPipeline.log_prob_passes(pipeline, DataProto.from_dict(tensors={"row": torch.arange(4)}), timings)
    assert {"ref_log_probs", "old_log_probs"} <= set(batch.batch.keys())
    if reference_devices == "2-3":
        assert log == ["reference log-probs (non-blocking)", "actor_train log-probs (non-blocking)"]
        assert "time/reference_and_old_log_probs_s" in timings
    else:  # on device 1 both: each pass offloads the other role first
        assert log == [
            "offload actor_train",
            "reference log-probs",
            "offload reference",
            "load actor_train",
            "actor_train log-probs",
        ]
        assert {"time/reference_log_probs_s", "time/old_log_probs_s"} <= set(timings)


def test_the_critic_trains_before_actor_train_on_what_the_losses_read() -> None:
    log: list[str] = []
    pipeline = stand_in({"actor_train": _role(1), "critic": _role(1)}, AlgorithmArguments(ppo_epochs=2), log)
    keys = ("advantages", "response_mask", "scores", "teacher_log_probs")
    batch = DataProto.from_dict(tensors={key: torch.zeros(2, 1) for key in keys})
    metrics: dict[str, float] = {}
    timings: dict[str, float] = {}
    RLVRPipeline.update(pipeline, batch, metrics, timings)
    read = "['advantages', 'response_mask']"
    assert log == [f"critic train {read}"] * 2 + [f"actor_train train {read}"] * 2
    assert metrics == {"critic/loss": 0.5, "actor/loss": 0.5}
    assert [key for key in timings if key.startswith("time/")] == ["time/critic_update_s", "time/actor_update_s"]
    assert pipeline.weights_stale and pipeline.versions.trained == 1  # one policy version for both epochs
