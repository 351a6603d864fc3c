"""Strict config conversion, device mappings and cross-field validation."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.schema import ConfigError, from_dict
from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.pipeline.cluster_check.cluster_check_config import CHECK_WORKER, ClusterCheckConfig


@dataclass
class Inner:
    rate: float = 0.1
    steps: int = 1
    names: list[str] = field(default_factory=list)


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    maybe: int | None = None
    flag: bool = False


def test_nested_conversion_keeps_values() -> None:
    outer = from_dict(Outer, {"inner": {"rate": 2, "names": ["a"]}, "maybe": 3, "flag": True})
    assert outer.inner.rate == 2.0 and isinstance(outer.inner.rate, float)
    assert outer.inner.names == ["a"] and outer.maybe == 3 and outer.flag is True


def test_unknown_key_names_path_and_closest_spelling() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'inner.stesp' \(did you mean 'steps'\?\)"):
        from_dict(Outer, {"inner": {"stesp": 3}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"inner": {"steps": "3"}}, r"inner.steps: expected int, got '3'"),
        ({"inner": {"steps": True}}, r"inner.steps: expected int, got True"),
        ({"flag": 1}, r"flag: expected bool, got 1"),
        ({"inner": {"names": "a"}}, r"inner.names: expected a list"),
        ({"inner": 5}, r"inner: expected a mapping"),
    ],
)
def test_wrong_types_are_errors_not_coercions(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, data)


def test_literal_field_lists_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"model_args.dtype: 'bf17' is not one of 'auto', 'fp32', 'bf16', 'fp16'"):
        from_dict(WorkerConfig, {"model_args": {"dtype": "bf17"}}, "")


@pytest.mark.parametrize(
    ("value", "devices"),
    [
        ([0, 2], [0, 2]),
        (3, [3]),
        ("0-3", [0, 1, 2, 3]),
        ("0,2,4-5", [0, 2, 4, 5]),
        ("list(range(0, 4))", [0, 1, 2, 3]),
        ("range(2)", [0, 1]),
        ("[0, 1]", [0, 1]),
    ],
)
def test_device_mapping_forms(value: object, devices: list[int]) -> None:
    assert parse_device_mapping(value, "actor.device_mapping") == devices


def test_all_devices_follow_the_clusters_size() -> None:
    assert parse_device_mapping("all", "actor.device_mapping", total_devices=3) == [0, 1, 2]
    assert parse_device_mapping("all", "actor.device_mapping") == []  # the schema's check, before the size is known
    config = check_config(num_nodes=2, actor_train={"worker_cls": CHECK_WORKER, "device_mapping": "all"})
    assert config.actor_train.devices == [0, 1, 2, 3] and config.actor_train.world_size == 4


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("__import__('os')", "cannot parse"),
        ("3-1", "runs backwards"),
        ("0,1,1", r"lists device\(s\) \[1\] more than once"),
        ([], "is empty"),
        ([-1], "non-negative"),
    ],
)
def test_device_mapping_errors(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_device_mapping(value, "actor.device_mapping")


def check_config(**overrides: object) -> ClusterCheckConfig:
    data = {
        "platform": "cpu",
        "devices_per_node": 2,
        "actor_train": {"worker_cls": CHECK_WORKER, "device_mapping": "0-1"},
    }
    data.update(overrides)
    config = from_dict(ClusterCheckConfig, data)
    config.validate()
    return config


def test_valid_config_resolves_roles() -> None:
    config = check_config(actor_infer={"worker_cls": CHECK_WORKER, "device_mapping": [1]})
    assert config.actor_train.devices == [0, 1] and config.actor_train.world_size == 2
    assert config.actor_infer is not None and config.actor_infer.name == "actor_infer"
    assert list(config.roles()) == ["actor_train", "actor_infer"]


def test_device_beyond_cluster_names_field_and_fix() -> None:
    with pytest.raises(
        ConfigError, match=r"actor_train.device_mapping uses device\(s\) \[2, 3\] but the cluster has 2"
    ):
        check_config(actor_train={"worker_cls": CHECK_WORKER, "device_mapping": "0-3"})


def test_batch_not_divisible_by_dp_names_both_fields() -> None:
    with pytest.raises(ConfigError, match="batch_size=5 does not divide by actor_train's data-parallel size 2"):
        check_config(batch_size=5)


def test_unknown_strategy_lists_valid_names() -> None:
    role = {"worker_cls": CHECK_WORKER, "device_mapping": 0, "strategy_args": {"strategy_name": "deepspeed_trian"}}
    with pytest.raises(ConfigError, match=r"'deepspeed_trian' is unknown \(did you mean 'deepspeed_train'\?\); valid"):
        check_config(actor_train=role)


def test_options_for_a_backend_without_options_are_an_error() -> None:
    strategy = {"strategy_name": "hf_infer", "strategy_config": {"zero_optimization": {"stage": 3}}}
    role = {"worker_cls": CHECK_WORKER, "device_mapping": 0, "strategy_args": strategy}
    with pytest.raises(ConfigError, match=r"actor_train.strategy_args.strategy_config sets \['zero_optimization'\]"):
        check_config(actor_train=role)


def test_world_size_contradicting_mapping() -> None:
    with pytest.raises(ConfigError, match=r"actor_train\.world_size=3 contradicts"):
        check_config(actor_train={"worker_cls": CHECK_WORKER, "device_mapping": "0-1", "world_size": 3})


def test_worker_must_not_span_nodes() -> None:
    role = {"worker_cls": CHECK_WORKER, "device_mapping": "1-2", "num_devices_per_worker": 2}
    with pytest.raises(ConfigError, match=r"spans nodes \[0, 1\]"):
        check_config(num_nodes=2, actor_train=role)


def test_role_without_devices_needs_world_size() -> None:
    with pytest.raises(ConfigError, match="needs a device_mapping"):
        check_config(actor_infer={"worker_cls": CHECK_WORKER})
    config = check_config(actor_infer={"worker_cls": CHECK_WORKER, "world_size": 2})
    assert config.actor_infer is not None and config.actor_infer.devices == []


def test_user_values_are_not_rewritten() -> None:
    config = check_config(actor_train={"worker_cls": CHECK_WORKER, "device_mapping": "0-1"})
    assert config.actor_train.device_mapping == "0-1"
    assert GeneratingArguments().temperature == 1.0
