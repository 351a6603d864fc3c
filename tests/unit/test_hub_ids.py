"""Models and datasets given by hub id: fetched from a pre-filled Hugging Face cache in offline mode.

The cache is laid out as huggingface_hub writes it (`hub/models--org--name/snapshots/<commit>/`, `refs/<branch>`
holding the commit), and the real `snapshot_download` and `datasets.load_dataset` read it. huggingface_hub and
datasets read HF_HOME and HF_HUB_OFFLINE once, when imported, so the fixture points their cache and offline settings
at the test's (tests/integration/test_hub_ids.py sets the environment variables of a fresh process instead).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pytest

from roll.configs.data_config import DataArguments
from roll.configs.loader import load_pipeline_config
from roll.configs.schema import ConfigError
from roll.datasets.prompt_dataset import load_splits
from roll.models.hub import HUB_ENV, HubRef, parse_hub_ref, resolve_model_id
from roll.models.tiny import build_char_tokenizer, make_tiny_model
from roll.pipeline.distill.distill_config import DistillConfig
from roll.pipeline.dpo.dpo_config import DPOConfig
from roll.pipeline.sft.sft_config import SFTConfig
from tests.pipeline_runs import config_error_of
from tests.unit.test_config_validation import BLOCKS, ON_THIS_MACHINE
from tests.unit.test_hydra_configs import compose_config

MAIN, V1 = "a" * 40, "b" * 40  # the commits of org/tiny's main branch and of its tag v1


def snapshot_dir(hub: Path, kind: str, repo: str, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """The snapshot folder of `repo` at `commit` in the hub cache `hub`, with `refs` pointing at that commit."""
    folder = hub / f"{kind}s--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    return folder / "snapshots" / commit


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """`rows` as JSON lines at `path`, its folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def fill_cache(hf_home: Path) -> None:
    """org/tiny (main, and tag v1 at another commit of another seed), org/toy (a default subset with train and test
    splits, a subset `easy`), and org/bad (a row whose conversation has an unknown role)."""
    hub = hf_home / "hub"
    make_tiny_model(snapshot_dir(hub, "model", "org/tiny", MAIN))
    make_tiny_model(snapshot_dir(hub, "model", "org/tiny", V1, refs=("v1",)), seed=1)
    toy = snapshot_dir(hub, "dataset", "org/toy", MAIN)
    write_jsonl(toy / "data" / "train.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)])
    write_jsonl(toy / "data" / "test.jsonl", [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(3)])
    write_jsonl(toy / "easy" / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (toy / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train.jsonl\n"
        "  - split: test\n    path: data/test.jsonl\n- config_name: easy\n  data_files:\n  - split: train\n"
        "    path: easy/train.jsonl\n---\n"
    )
    bad = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * 2
    bad.append({"prompt": [{"role": "robot", "content": "1+1="}], "answer": "2"})
    write_jsonl(snapshot_dir(hub, "dataset", "org/bad", MAIN) / "train.jsonl", bad)


@pytest.fixture(scope="module")
def filled_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    fill_cache(home)
    return home


@pytest.fixture
def hub(filled_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The pre-filled cache, offline; returns its hub folder."""
    monkeypatch.setenv("HF_HOME", str(filled_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(HUB_ENV, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(filled_home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    return filled_home / "hub"


def test_what_reads_as_a_hub_id(tmp_path: Path) -> None:
    assert parse_hub_ref("Qwen/Qwen2.5-0.5B-Instruct") == HubRef("Qwen/Qwen2.5-0.5B-Instruct")
    assert parse_hub_ref("org/name@v1.0") == HubRef("org/name", "v1.0")
    assert parse_hub_ref("org/name@refs/pr/3") == HubRef("org/name", "refs/pr/3")
    assert parse_hub_ref("openai/gsm8k@main?subset=main&split=test", "dataset") == HubRef(
        "openai/gsm8k", "main", "main", "test"
    )
    assert parse_hub_ref("org/data.v2", "dataset") == HubRef("org/data.v2")
    (tmp_path / "org" / "name").mkdir(parents=True)
    local = str(tmp_path / "org" / "name")
    for value in ("tiny://qwen2", "tiny-diffusion://unet", "./org/name", "/models/x", "a/b/c", "gpt2", local):
        assert parse_hub_ref(value) is None, value
    assert parse_hub_ref("org/name?split=test") is None  # options are for datasets
    assert parse_hub_ref("data/train.jsonl", "dataset") is None  # a missing file, not a repository
    with pytest.raises(ValueError, match="'spilt=test' is not subset=<name> or split=<name>"):
        parse_hub_ref("org/toy?spilt=test", "dataset")


def test_validation_puts_the_snapshot_in_every_role_that_names_the_id(hub: Path, tmp_path: Path) -> None:
    main = hub / "models--org--tiny" / "snapshots" / MAIN
    base = [*ON_THIS_MACHINE, f"output_dir={tmp_path}"]
    sft = compose_config("sft_arithmetic", [*base, "actor_train.model_args.model_name_or_path=org/tiny"])
    assert load_pipeline_config(sft, SFTConfig, BLOCKS).actor_train.model_args.model_name_or_path == str(main)
    # pretrain before the roles' checks: DPO's written-export check and the teacher's must let an id through.
    dpo = load_pipeline_config(compose_config("dpo_arithmetic", [*base, "pretrain=org/tiny"]), DPOConfig, BLOCKS)
    assert {role.model_args.model_name_or_path for role in dpo.roles().values()} == {str(main)}
    distill = compose_config("distill_arithmetic", [*base, "pretrain=org/tiny"])
    assert load_pipeline_config(distill, DistillConfig, BLOCKS).teacher.model_args.model_name_or_path == str(main)


def test_a_revision_is_a_branch_tag_or_commit(hub: Path) -> None:
    v1 = str(hub / "models--org--tiny" / "snapshots" / V1)
    assert resolve_model_id("org/tiny@v1", "pretrain") == v1
    assert resolve_model_id(f"org/tiny@{V1}", "pretrain") == v1
    assert resolve_model_id("tiny://qwen2", "pretrain") == "tiny://qwen2"


def test_an_uncached_id_is_a_config_error_before_ray(hub: Path, tmp_path: Path) -> None:
    args = [f"output_dir={tmp_path}", "actor_train.model_args.model_name_or_path=org/missing"]
    message = config_error_of("examples/start_sft_pipeline.py", *args)
    assert message == (
        "actor_train.model_args.model_name_or_path='org/missing': no local path of that name, and the Hugging Face "
        f"model org/missing is not in the cache ({hub}) while HF_HUB_OFFLINE is set: download it with `hf download "
        "org/missing` on a machine with network and copy its HF_HOME here, or unset HF_HUB_OFFLINE"
    )
    with pytest.raises(ConfigError, match=r"^pretrain='org/tiny@v2': .* `hf download org/tiny --revision v2` "):
        resolve_model_id("org/tiny@v2", "pretrain")


def test_a_hub_dataset_loads_its_subset_and_split(hub: Path) -> None:
    tokenizer = build_char_tokenizer()
    data = DataArguments(train_file="org/toy", eval_file="org/toy?split=test", apply_chat_template=False)
    train, held_out = load_splits(data, tokenizer)
    assert (len(train), len(held_out)) == (6, 3)
    assert [e.prompt for e in held_out] == ["0+2=", "1+2=", "2+2="]
    easy = DataArguments(train_file="org/toy?subset=easy", eval_file="org/toy?split=test", apply_chat_template=False)
    assert [e.prompt for e in load_splits(easy, tokenizer)[0]] == ["1+1="]


@pytest.mark.parametrize(
    ("train_file", "message"),
    [
        ("org/bad", r"^data.train_file='org/bad' row 2: role 'robot' is not one of system, user, assistant$"),
        (
            "org/toy?split=validation",
            r"^data.train_file='org/toy\?split=validation': the hub dataset org/toy does not read \(ValueError: "
            r"Unknown split \"validation\"",
        ),
        (
            "org/none",
            r"^data.train_file='org/none': no local path of that name, .* `hf download org/none --repo-type dataset`",
        ),
        ("org/toy?spilt=test", r"^data.train_file='org/toy\?spilt=test': 'spilt=test' is not subset=<name> or split="),
    ],
    ids=["bad row", "unknown split", "not cached", "unknown option"],
)
def test_hub_dataset_errors_name_the_setting_and_the_row(hub: Path, train_file: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_splits(DataArguments(train_file=train_file, eval_file="org/toy?split=test"), build_char_tokenizer())


def test_the_hub_switch(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HUB_ENV, "modelscope")
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed, whatever this machine has
    with pytest.raises(ConfigError, match=rf"^pretrain='org/tiny': {HUB_ENV}=modelscope needs the modelscope package"):
        resolve_model_id("org/tiny", "pretrain")
    monkeypatch.setenv(HUB_ENV, "gitlab")
    with pytest.raises(ConfigError, match=rf"{HUB_ENV}='gitlab' is not one of huggingface, modelscope"):
        resolve_model_id("org/tiny", "pretrain")
