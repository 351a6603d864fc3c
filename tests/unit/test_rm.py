"""The reward-model pipeline's pieces: the Bradley-Terry loss by hand, scoring at the last token, config errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from roll.algorithms.reward_model_losses import bradley_terry_loss
from roll.configs.data_config import PreferenceDataArguments
from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.configs.worker_config import ModelArguments
from roll.datasets.arithmetic import arithmetic_problems
from roll.datasets.preference_dataset import encode_pairs, load_preference_splits
from roll.models.model_providers import load_model, load_tokenizer
from roll.pipeline.base.reward_model_worker import sequence_scores
from roll.pipeline.rlvr.rlvr_config import REWARD_MODEL_WORKER, RLVRConfig, check_reward_model_dir
from roll.pipeline.rm.rm_config import RMConfig
from roll.pipeline.rm.rm_worker import pairwise_objective
from tests.conftest import CONFIG_DIR
from tests.unit.test_hydra_configs import compose_config


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_bradley_terry_loss_by_hand() -> None:
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + exp(-d)) for d = chosen - rejected = 1, 0, -2
    expected = [softplus(-1.0), math.log(2.0), softplus(2.0)]
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx(expected, rel=1e-6)


def test_margin_shifts_the_gap_as_a_constant_or_per_pair() -> None:
    chosen, rejected = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 0.5])
    # d - margin = 1 - 1 = 0 and 0 - 1 = -1
    assert bradley_terry_loss(chosen, rejected, 1.0).tolist() == pytest.approx([math.log(2.0), softplus(1.0)])
    per_pair = bradley_terry_loss(chosen, rejected, torch.tensor([0.5, 2.0]))
    assert per_pair.tolist() == pytest.approx([softplus(-0.5), softplus(2.0)])


def test_pairwise_objective_reads_pairs_interleaved_and_its_gradient_ranks_chosen_up() -> None:
    scores = torch.tensor([3.0, 1.0, 0.0, 2.0], requires_grad=True)  # pairs (3 over 1) and (0 over 2)
    loss, metrics = pairwise_objective(scores, margin=0.0)
    assert loss.item() == pytest.approx((softplus(-2.0) + softplus(2.0)) / 2)
    assert metrics["accuracy"].item() == 0.5
    assert metrics["rewards/chosen"].item() == 1.5 and metrics["rewards/rejected"].item() == 1.5
    assert metrics["rewards/margin"].item() == 0.0
    loss.backward()
    assert scores.grad is not None
    assert (scores.grad[0::2] < 0).all() and (scores.grad[1::2] > 0).all()  # descent raises chosen, lowers rejected


def test_a_reward_model_scores_a_padded_pair_as_each_response_alone() -> None:
    """The score of a row is read at its last token: the pairs' padding (prompts left, responses right) is ignored."""
    tokenizer = load_tokenizer("tiny://qwen2")
    model = load_model(ModelArguments(model_name_or_path="tiny://qwen2", dtype="fp32"), "reward").eval()
    train, _ = load_preference_splits(PreferenceDataArguments(apply_chat_template=False), tokenizer, 6)
    pairs = [pair for pair in train if len(pair.chosen.response_ids) != len(pair.rejected.response_ids)][:2]
    batch = encode_pairs(pairs, tokenizer.pad_token_id).batch
    with torch.no_grad():
        padded = sequence_scores(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
        alone = [
            sequence_scores(model(input_ids=torch.tensor([[*e.prompt_ids, *e.response_ids]]))).item()
            for pair in pairs
            for e in (pair.chosen, pair.rejected)
        ]
    assert padded.shape == (4,) and padded.tolist() == pytest.approx(alone, abs=1e-5)


def rm(*overrides: str) -> RMConfig:
    cfg = compose_config("rm_arithmetic", ["platform=cpu", "devices_per_node=2", "pretrain=tiny://qwen2", *overrides])
    return load_pipeline_config(cfg, RMConfig, yaml_names([CONFIG_DIR]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward_model.training_args.per_device_train_batch_size=15", "batch_size=15"], "must be even"),
        (["batch_size=16"], "batch_size=16 pairs are 32 rows, which must equal"),
        (["reward_model.max_tokens_per_microbatch=512"], "reward_model.max_tokens_per_microbatch must be null"),
        (
            ["reward_model.strategy_args.strategy_name=hf_infer", "reward_model.strategy_args.strategy_config={}"],
            "reward_model.strategy_args.strategy_name=hf_infer does not train",
        ),
        (["margin=-1"], r"margin=-1.0 is out of range"),
        (["resume_from_checkpoint=latest"], "resume_from_checkpoint='latest'"),
        (["batch_size=1000", "reward_model.training_args.per_device_train_batch_size=1000"], "batch_size=1000 is more"),
    ],
)
def test_rm_relations_are_one_line_errors_naming_the_field(overrides: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        rm(f"output_dir={tmp_path}", *overrides)
    assert "\n" not in str(error.value)


def test_the_rm_yaml_validates_and_plans_pairs() -> None:
    config = rm()
    assert config.reward_model.worker_cls.endswith("RewardTrainWorker") and config.margin == 0.0
    assert config.batch_plan()[0] == "pairs: 32 per optimizer step = 64 rows (chosen and rejected side by side)"
    assert len(arithmetic_problems(seed=0)[0]) >= config.batch_size


def write_model_config(directory: Path, architectures: list[str], labels: int) -> str:
    directory.mkdir(parents=True)
    id2label = {str(i): f"LABEL_{i}" for i in range(labels)}
    (directory / "config.json").write_text(json.dumps({"architectures": architectures, "id2label": id2label}))
    return str(directory)


def test_an_exported_reward_model_passes(tmp_path: Path) -> None:
    check_reward_model_dir(write_model_config(tmp_path / "rm", ["Qwen2ForSequenceClassification"], 1), "f")


@pytest.mark.parametrize(
    ("architectures", "labels", "message"),
    [
        (["Qwen2ForCausalLM"], 1, r"is not a reward model: architectures \['Qwen2ForCausalLM'\]"),
        (["Qwen2ForSequenceClassification"], 2, r"is not a reward model: .* with 2 label\(s\)"),
    ],
)
def test_a_directory_that_is_no_reward_model_is_refused(
    architectures: list[str], labels: int, message: str, tmp_path: Path
) -> None:
    path = write_model_config(tmp_path / "model", architectures, labels)
    with pytest.raises(ConfigError, match=f"rewards.rm.model_args.model_name_or_path='{path}' {message}"):
        check_reward_model_dir(path, "rewards.rm.model_args.model_name_or_path")


def rlvr_with_reward_model(tmp_path: Path, *overrides: str) -> RLVRConfig:
    cfg = compose_config(
        "rlvr_arithmetic",
        [
            "platform=cpu",
            "devices_per_node=2",
            "pretrain=tiny://qwen2",
            f"output_dir={tmp_path}",
            f"rewards.math.worker_cls={REWARD_MODEL_WORKER}",
            *overrides,
        ],
    )
    return load_pipeline_config(cfg, RLVRConfig, yaml_names([CONFIG_DIR]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rewards.math.strategy_args.strategy_name=hf_infer"],
            r"rewards.math.model_args.model_name_or_path='tiny://qwen2' is a causal LM, not a reward model",
        ),
        (
            ["rewards.math.strategy_args.strategy_name=deepspeed_train"],
            "rewards.math.strategy_args.strategy_name=deepspeed_train: a reward-model cluster needs an inference",
        ),
    ],
)
def test_rlvr_refuses_a_reward_model_cluster_without_a_reward_model_or_strategy(
    overrides: list[str], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        rlvr_with_reward_model(tmp_path, *overrides)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rewards.math.reward_weights=[1.0]", r"rewards\.math\.reward_weights weighs reward_fn entries"),
        ("rewards.math.max_tokens_per_microbatch=64", r"rewards\.math\.max_tokens_per_microbatch must be null"),
    ],
)
def test_rlvr_refuses_function_and_packing_options_on_a_reward_model_cluster(
    override: str, message: str, tmp_path: Path
) -> None:
    model = write_model_config(tmp_path / "rm", ["Qwen2ForSequenceClassification"], 1)
    overrides = [f"rewards.math.model_args.model_name_or_path={model}", override]
    with pytest.raises(ConfigError, match=message):
        rlvr_with_reward_model(tmp_path, "rewards.math.strategy_args.strategy_name=hf_infer", *overrides)
