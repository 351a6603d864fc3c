"""Which roles share a process per device, and what a role leaves in a host it leaves
(roll/distributed/executor/worker_host.py)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from roll.configs.worker_config import ModelArguments, StrategyArguments, WorkerConfig
from roll.distributed.executor.worker import Worker
from roll.distributed.executor.worker_host import HostedWorker, WorkerHost, actor_of, process_groups
from roll.third_party.deepspeed.process_state import reset_after_engine

ZERO2 = {"zero_optimization": {"stage": 2}}
ZERO3 = {"zero_optimization": {"stage": 3}}


def role(
    name: str, strategy: str, mapping: str | None = "0-1", block: dict[str, Any] | None = None, **kw: Any
) -> WorkerConfig:
    config = WorkerConfig(
        worker_cls="roll.pipeline.base.rl_workers.ActorWorker",
        device_mapping=mapping,
        world_size=None if mapping else 1,
        model_args=ModelArguments(model_name_or_path="tiny://qwen2", dtype="fp32"),
        strategy_args=StrategyArguments(strategy_name=strategy, strategy_config=block or {}),
        **kw,
    )
    config.resolve(name, 4)
    return config


def test_the_default_jobs_colocated_roles_share_one_process_per_device_and_rewards_stay_apart() -> None:
    roles = {
        "actor_train": role("actor_train", "deepspeed_train", block=ZERO2),
        "actor_infer": role("actor_infer", "hf_infer"),
        "reference": role("reference", "hf_infer"),
        "rewards.math": role("rewards.math", "hf_infer", mapping=None),
    }
    assert process_groups(roles) == [("actor_train", "actor_infer", "reference")]


def test_engines_zero3_other_devices_and_other_environments_keep_processes_of_their_own() -> None:
    roles = {
        "actor_train": role("actor_train", "deepspeed_train", block=ZERO2),
        "vllm": role("vllm", "vllm"),
        "zero3": role("zero3", "deepspeed_infer", block=ZERO3),
        "elsewhere": role("elsewhere", "hf_infer", mapping="2-3"),
        "own_env": role("own_env", "hf_infer", env_vars={"X": "1"}),
        "same": role("same", "hf_infer"),
    }
    assert process_groups(roles) == [("actor_train", "same")]


def test_a_second_process_group_role_is_left_out_and_a_lone_role_forms_no_group() -> None:
    roles = {
        "actor_train": role("actor_train", "deepspeed_train", block=ZERO2),
        "critic": role("critic", "deepspeed_train", block=ZERO2),
        "reference": role("reference", "hf_infer"),
    }
    assert process_groups(roles) == [("actor_train", "reference")]
    assert process_groups({"actor_train": roles["actor_train"], "critic": roles["critic"]}) == []


def test_a_hosted_worker_is_called_like_an_actor_handle_through_its_host() -> None:
    calls = []

    class Host:
        class call:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> str:
                calls.append((args, kwargs))
                return "ref"

    worker = HostedWorker(Host, "reference")  # type: ignore[arg-type]
    assert worker.compute_log_probs.remote(1, x=2) == "ref"
    assert calls == [(("reference", "compute_log_probs", 1), {"x": 2})]
    assert actor_of(worker) is Host and actor_of("handle") == "handle"


# What CarelessWorker keeps alive after it closed.
KEPT: list[object] = []


class LeftBehind(torch.nn.Module):
    """A model a role keeps alive after it left."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))


class Zero3Config:
    """Stands for transformers' HfDeepSpeedConfig of a ZeRO-3 role."""

    def is_zero3(self) -> bool:
        return True


class CarelessWorker(Worker):
    """Forms a process group that DeepSpeed caches, switches transformers' ZeRO-3 mode and AutoTP's training mode on,
    numbers parameters as zero.Init does and keeps a model; its close releases none of them."""

    def __init__(self, worker_config: WorkerConfig) -> None:
        from deepspeed.module_inject import set_autotp_mode
        from deepspeed.runtime.zero.partition_parameters import Init
        from deepspeed.utils import groups
        from transformers.integrations import set_hf_deepspeed_config

        super().__init__(worker_config)
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        groups._WORLD_GROUP = torch.distributed.group.WORLD  # as ZeRO caches its data-parallel group
        KEPT.extend([LeftBehind(), Zero3Config()])
        set_hf_deepspeed_config(KEPT[-1])
        set_autotp_mode(training=True)
        Init.param_id = 3


class BrokenWorker(Worker):
    """Fails to start."""

    def __init__(self, worker_config: WorkerConfig) -> None:
        raise RuntimeError("no model")


def rank_env(**extra: str) -> dict[str, str]:
    """A one-rank role's variables (this process's thread count kept)."""
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "ROLL_NUM_THREADS": str(torch.get_num_threads()),
        **extra,
    }


def test_a_host_is_unclean_while_a_role_is_in_it_or_failed_there_and_clean_once_they_are_removed() -> None:
    host = WorkerHost()
    before = host.leftovers()  # this test process may hold models of its own: only the difference counts
    host.add("echo", Worker, WorkerConfig(), rank_env(ROLL_TEST_ROLE_VARIABLE="1"))
    with pytest.raises(RuntimeError, match="no model"):
        host.add("broken", BrokenWorker, WorkerConfig(), rank_env())
    try:
        found = host.leftovers()
    finally:
        host.remove("echo")
        host.remove("broken")
    assert "role 'echo' is still hosted" in found and "role 'broken' failed and was not removed" in found
    changed = next(line for line in found if line.startswith("environment variables differ"))
    assert "ROLL_TEST_ROLE_VARIABLE" in changed and "RANK" in changed
    assert host.leftovers() == before
    assert "ROLL_TEST_ROLE_VARIABLE" not in os.environ


def test_a_host_names_the_process_group_modes_counters_and_models_a_removed_role_left_behind() -> None:
    from deepspeed.utils import groups
    from transformers.integrations import unset_hf_deepspeed_config

    host = WorkerHost()
    before = host.leftovers()
    host.add("careless", CarelessWorker, WorkerConfig(), rank_env())
    host.remove("careless")
    try:
        found = [line for line in host.leftovers() if line not in before]
    finally:
        torch.distributed.destroy_process_group()
        groups._WORLD_GROUP = None
        unset_hf_deepspeed_config()
        reset_after_engine(KEPT[0])  # AutoTP's mode and zero.Init's counters
        KEPT.clear()
    assert found == [
        "torch's default process group is still initialised",
        "transformers is still in ZeRO-3 mode (an HfDeepSpeedConfig is alive)",
        "DeepSpeed still caches the process group _WORLD_GROUP",
        "DeepSpeed's AutoTP is still in training mode",
        "zero.Init's counters are not reset: "
        "{'param_id': 3, 'num_persisted_parameters': 0, 'num_persisted_elements': 0}",
        "1 LeftBehind object(s) still alive",
    ]
    assert host.leftovers() == before
