"""Which roles share a process per device (roll/distributed/executor/worker_host.py)."""

from __future__ import annotations

from typing import Any

from roll.configs.worker_config import ModelArguments, StrategyArguments, WorkerConfig
from roll.distributed.executor.worker_host import HostedWorker, actor_of, process_groups

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
