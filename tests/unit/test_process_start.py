"""What a rank's Ray actor is started with: only what must precede its process goes into a runtime_env."""

from __future__ import annotations

from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.cluster import process_start_options
from roll.distributed.scheduler.resource_manager import WorkerPlacement


def placement(env: dict[str, str]) -> WorkerPlacement:
    return WorkerPlacement(place=None, env=env, ray_options={"num_cpus": 1})


def test_a_cpu_rank_without_role_variables_starts_in_one_of_rays_idle_processes() -> None:
    options = process_start_options(WorkerConfig(), placement({"LOCAL_RANK": "0"}))
    assert options == {"num_cpus": 1}  # no runtime_env: RANK, LOCAL_RANK and the rest come with the constructor


def test_role_variables_and_device_visibility_are_in_place_when_the_process_starts() -> None:
    config = WorkerConfig(env_vars={"NCCL_DEBUG": "INFO"})
    env = {"CUDA_VISIBLE_DEVICES": "1", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "0"}
    options = process_start_options(config, placement(env))
    assert options["runtime_env"] == {
        "env_vars": {
            "NCCL_DEBUG": "INFO",
            "CUDA_VISIBLE_DEVICES": "1",
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        }
    }
    assert options["num_cpus"] == 1
