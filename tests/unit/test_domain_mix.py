"""Domain mixing (`data.domain_weights`) and the check that every domain of the data has a reward cluster."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from roll.configs.loader import load_pipeline_config
from roll.configs.schema import ConfigError
from roll.datasets.prompt_dataset import DomainMixSampler, Example, domain_counts
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from tests.unit.test_config_validation import BLOCKS, ON_THIS_MACHINE
from tests.unit.test_hydra_configs import compose_config


def examples(domain: str, n: int) -> list[Example]:
    return [Example(f"{domain}{i}", answer="0", domain=domain, prompt_ids=[i], response_ids=[]) for i in range(n)]


def test_counts_follow_the_weights_and_round_by_largest_remainder() -> None:
    assert domain_counts(8, {"math": 3, "code": 1}) == {"math": 6, "code": 2}
    assert domain_counts(8, {"a": 1, "b": 1, "c": 1}) == {"a": 3, "b": 3, "c": 2}  # ties go to the first name
    assert domain_counts(5, {"a": 0.5, "b": 0.3, "c": 0.2}) == {"a": 3, "b": 1, "c": 1}  # 2.5, 1.5, 1.0
    with pytest.raises(ValueError, match=r"\['b'\] get no row of a batch of 4"):
        domain_counts(4, {"a": 100, "b": 1})


def test_every_batch_holds_each_domains_share_and_a_checkpoint_continues_it() -> None:
    pool = examples("math", 10) + examples("code", 3)
    sampler = DomainMixSampler(pool, 4, seed=0, weights={"math": 3, "code": 1})
    batches = [sampler.next_batch() for _ in range(5)]
    assert all(Counter(e.domain for e in batch) == {"math": 3, "code": 1} for batch in batches)
    seen_code = [e.prompt for batch in batches[:3] for e in batch if e.domain == "code"]
    assert sorted(seen_code) == ["code0", "code1", "code2"], "one epoch of a domain shows each of its rows once"
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(3)]
    resumed = DomainMixSampler(pool, 4, seed=0, weights={"math": 3, "code": 1})
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    assert [resumed.next_batch() for _ in range(3)] == expected


@pytest.fixture
def two_domain_file(tmp_path: Path) -> Path:
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "domain": "math" if i % 4 else "logic"} for i in range(64)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rlvr_config(data_file: Path, tmp_path: Path, *overrides: str) -> RLVRConfig:
    files = [f"data.train_file={data_file}", f"data.eval_file={data_file}", "pretrain=tiny://qwen2"]
    cfg = compose_config("rlvr_arithmetic", [*ON_THIS_MACHINE, f"output_dir={tmp_path}", *files, *overrides])
    return load_pipeline_config(cfg, RLVRConfig, BLOCKS)


def test_a_domain_without_a_reward_cluster_is_a_config_error(two_domain_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"domain\(s\) \['logic'\] that no reward cluster scores"):
        rlvr_config(two_domain_file, tmp_path)
    config = rlvr_config(two_domain_file, tmp_path, "rewards.math.domains=[math,logic]")
    assert config.rewards["math"].domains == ["math", "logic"]


def test_domain_weights_must_name_the_datas_domains_and_give_each_a_row(two_domain_file: Path, tmp_path: Path) -> None:
    served = "rewards.math.domains=[math,logic]"
    with pytest.raises(ConfigError, match=r"data.domain_weights names domain\(s\) \['math'\] but the training"):
        rlvr_config(two_domain_file, tmp_path, served, "+data.domain_weights={math: 1}")
    with pytest.raises(ConfigError, match=r"^data.domain_weights: domain\(s\) \['logic'\] get no row"):
        rlvr_config(two_domain_file, tmp_path, served, "+data.domain_weights={math: 100, logic: 1}")
    config = rlvr_config(two_domain_file, tmp_path, served, "+data.domain_weights={math: 3, logic: 1}")
    assert config.data.domain_weights == {"math": 3, "logic": 1}
