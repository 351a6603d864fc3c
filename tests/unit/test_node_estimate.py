"""The node estimate of a CPU run: every process's memory summed, and a run that will not fit refused before Ray."""

from __future__ import annotations

import pytest

from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.pipeline.base.dry_run.model_states import GiB
from roll.pipeline.base.dry_run.node_estimate import (
    DRIVER_AND_RAY_BYTES,
    RUNTIME_BYTES,
    check_node_memory,
    estimate_nodes,
)
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.platforms.cpu import CpuPlatform
from tests.conftest import CONFIG_DIR, REPO_ROOT
from tests.in_process import Outcome, run_in_process
from tests.unit.test_hydra_configs import compose_config

RECIPE = "rlvr_qwen2.5_0.5b_cpu"
# Every role on 8 ranks of one node: eight copies of a 0.5B model's weights, and of its Adam states.
EIGHT_RANKS = [
    "devices_per_node=8",
    "rollout_batch_size=16",
    *(
        f"{role}.{key}"
        for role in ("actor_train", "actor_infer", "reference")
        for key in ("device_mapping=0-7", "num_devices_per_worker=1")
    ),
]


# The recipe's `dtype: auto` is bf16 or fp32 by the CPU: the sums below are fp32's, whichever machine runs them.
FP32 = [f"{role}.model_args.dtype=fp32" for role in ("actor_train", "actor_infer", "reference")]


def recipe(*overrides: str) -> RLVRConfig:
    return load_pipeline_config(compose_config(RECIPE, [*FP32, *overrides]), RLVRConfig, yaml_names([CONFIG_DIR]))


def test_the_node_sums_every_process_and_adds_one_roles_peak_phase() -> None:
    [node] = estimate_nodes(recipe(), host_memory=24 * GiB)
    assert [p.label for p in node.processes] == ["actor_train/0", "actor_infer/0", "reference/0", "rewards.math/0"]
    assert [p.process for p in node.processes] == ["actor_train/0"] * 3 + ["rewards.math/0"]
    train, infer, reference, reward = node.processes
    shared = "(in actor_train/0's process)"
    assert f"actor_infer/0 {shared}: runtime" in "\n".join(node.lines())
    # The three colocated roles share one process (share_worker_processes): one runtime, the trainer's.
    assert train.runtime == RUNTIME_BYTES["train"] and infer.runtime == reference.runtime == 0
    # fp32 ZeRO-0: weights, gradients and Adam's two moments, 4 + 4 + 8 bytes a parameter (494M, tied).
    assert train.resident == pytest.approx(16 * 494_032_768, rel=1e-3)
    # actor_infer's weights are overwritten by every sync, so copied; the reference's stay the fp32 checkpoint's
    # mapped pages (page cache, counted once and apart from the used memory).
    assert infer.resident == reference.mapped == node.page_cache == pytest.approx(4 * 494_032_768, rel=1e-3)
    assert reference.resident == 0 and infer.mapped == 0
    assert reward.resident == 0 and reward.runtime == RUNTIME_BYTES["plain"]
    steady = DRIVER_AND_RAY_BYTES + sum(p.runtime + p.resident for p in node.processes)
    # A synchronous step: only the largest role's phase (the actor's optimizer step) comes on top.
    assert node.peak_roles == ("actor_train",)
    assert node.total == steady + train.phase_peak
    assert sum(node.terms().values()) == node.total
    assert node.largest_term.startswith("actor_train Adam m+v 3.68 GiB")
    # Per OS process: the three roles' runtimes and states add up, and the largest of their phases comes on top.
    assert node.process_peaks() == {
        "actor_infer/0 + actor_train/0 + reference/0": train.runtime
        + train.resident
        + infer.resident
        + max(train.phase_peak, infer.phase_peak, reference.phase_peak),
        "rewards.math/0": reward.peak,
    }
    assert not node.over and node.budget == int(0.95 * 24 * GiB)


def test_generation_ahead_of_training_adds_the_generating_roles_phase() -> None:
    [sync] = estimate_nodes(recipe(), host_memory=24 * GiB)
    own_device = [
        "algorithm.tis_cap=2.0",
        "devices_per_node=3",
        "actor_infer.device_mapping=2",
        "actor_infer.num_devices_per_worker=1",
    ]
    [ahead] = estimate_nodes(recipe("async_generation_ratio=1", *own_device), host_memory=24 * GiB)
    infer = next(p for p in ahead.processes if p.role == "actor_infer")
    assert ahead.peak_roles == ("actor_infer", "actor_train")
    # On a slot of its own, actor_infer also leaves the trainer's process for one of its own.
    assert ahead.total == sync.total + infer.phase_peak + infer.runtime and infer.runtime == RUNTIME_BYTES["infer"]


def test_a_run_that_will_not_fit_is_a_config_error_naming_its_largest_term() -> None:
    config = recipe(*EIGHT_RANKS)
    [node] = estimate_nodes(config)
    assert node.over
    with pytest.raises(ConfigError, match=r"will not fit in host memory: node 0 needs ~\d+\.\d GiB.*largest term is "):
        check_node_memory(config)
    config.memory_check = False
    assert check_node_memory(config)[0].over  # reported, not refused


def start_recipe(*overrides: str) -> Outcome:
    """The RLVR entry point on the recipe, as a user starts it, run in this process (where starting Ray fails it)."""
    return run_in_process(
        ["python", "examples/start_rlvr_pipeline.py", f"--config-name={RECIPE}", *overrides], REPO_ROOT
    )


def test_the_real_command_refuses_it_before_ray_starts() -> None:
    # Refused from the model's shape alone (its 2 GB of weights are not built).
    result = start_recipe(*EIGHT_RANKS)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "will not fit in host memory" in result.stderr and "largest term is actor_train" in result.stderr
    assert "Started a local Ray instance" not in result.stderr + result.stdout
    dry = start_recipe(*EIGHT_RANKS, "dry_run=true")
    # The dry run prints the plan with every term, then ends with the same config error.
    assert dry.returncode == 2, dry.stderr[-2000:]
    assert "node 0 will not fit" in dry.stdout and "largest term is actor_train" in dry.stderr


def test_a_reference_in_another_dtype_copies_its_weights() -> None:
    [node] = estimate_nodes(recipe("reference.model_args.dtype=bf16"), host_memory=24 * GiB)
    reference = next(p for p in node.processes if p.role == "reference")
    assert reference.mapped == 0 and node.page_cache == 0
    assert reference.resident == pytest.approx(2 * 494_032_768, rel=1e-3)


def test_roles_in_processes_of_their_own_each_pay_a_runtime() -> None:
    [shared] = estimate_nodes(recipe(), host_memory=24 * GiB)
    [apart] = estimate_nodes(recipe("share_worker_processes=false"), host_memory=24 * GiB)
    assert [p.label for p in apart.processes] == ["actor_train/0", "actor_infer/0", "reference/0", "rewards.math/0"]
    assert apart.total - shared.total == 2 * RUNTIME_BYTES["infer"]


def test_the_recipe_trains_in_bf16_only_on_cpus_that_compute_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dtype: auto` in the recipe: bf16 (with DeepSpeed's fp32 master copy, estimated) where the CPU has bf16
    instructions, fp32 (no master copy at stage 0) elsewhere."""
    for choice, master in (("bf16", 4 * 494_032_768), ("fp32", 0)):
        monkeypatch.setattr(CpuPlatform, "preferred_dtype", lambda self, choice=choice: choice)
        config = load_pipeline_config(compose_config(RECIPE, []), RLVRConfig, yaml_names([CONFIG_DIR]))
        assert {role.model_args.dtype for name, role in config.roles().items() if name != "rewards.math"} == {choice}
        [node] = estimate_nodes(config, host_memory=24 * GiB)
        assert node.terms().get("actor_train fp32 master", 0) == pytest.approx(master, rel=1e-3)
