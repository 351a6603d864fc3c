"""DPO: the preference losses against hand-computed values, the pair data, and the config's checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from roll.algorithms.preference_losses import dpo_loss, ranking_accuracy, sequence_log_probs
from roll.configs.data_config import PreferenceDataArguments
from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import arithmetic_problems, wrong_answers
from roll.datasets.preference_dataset import encode_pairs, load_preference_splits
from roll.models.model_providers import load_tokenizer
from roll.pipeline.dpo.dpo_config import DPOConfig, PreferenceLossArguments
from roll.pipeline.dpo.dpo_worker import pair_objective
from tests.conftest import CONFIG_DIR
from tests.unit.test_hydra_configs import compose_config

# Two pairs of sequence log-probs. Pair 1: h = (-1 - -3) - (-2 - -2) = 2; pair 2: h = (-3 - -2) - 0 = -1.
POLICY_CHOSEN, POLICY_REJECTED = torch.tensor([-1.0, -3.0]), torch.tensor([-3.0, -2.0])
REFERENCE_CHOSEN, REFERENCE_REJECTED = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
PAIRS = (POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED)
BETA = 0.5


def log1p_exp(x: float) -> float:
    return math.log(1 + math.exp(x))  # -log sigmoid(-x)


def test_sigmoid_loss_and_rewards_by_hand() -> None:
    losses, chosen_rewards, rejected_rewards = dpo_loss(*PAIRS, beta=BETA)
    # -log sigmoid(beta h): beta h = 1 and -0.5.
    assert torch.allclose(losses, torch.tensor([log1p_exp(-1.0), log1p_exp(0.5)]))
    assert torch.allclose(losses, torch.tensor([0.3132617, 0.9740770]))
    assert torch.allclose(chosen_rewards, torch.tensor([0.5, -0.5]))
    assert torch.allclose(rejected_rewards, torch.tensor([-0.5, 0.0]))


def test_label_smoothing_mixes_in_the_flipped_label() -> None:
    losses, _, _ = dpo_loss(*PAIRS, beta=BETA, label_smoothing=0.1)
    # 0.9 (-log sigmoid(beta h)) + 0.1 (-log sigmoid(-beta h))
    expected = [0.9 * log1p_exp(-1.0) + 0.1 * log1p_exp(1.0), 0.9 * log1p_exp(0.5) + 0.1 * log1p_exp(-0.5)]
    assert torch.allclose(losses, torch.tensor(expected))
    assert torch.allclose(losses, torch.tensor([0.4132617, 0.9240770]))


def test_ipo_regresses_the_margin_to_half_over_beta() -> None:
    losses, _, _ = dpo_loss(*PAIRS, beta=BETA, loss_type="ipo")
    assert torch.allclose(losses, torch.tensor([(2 - 1.0) ** 2, (-1 - 1.0) ** 2]))


def test_dpo_gradient_raises_the_chosen_and_lowers_the_rejected() -> None:
    chosen, rejected = torch.tensor([-2.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    losses, _, _ = dpo_loss(chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=BETA)
    losses.sum().backward()
    assert chosen.grad.item() == pytest.approx(-BETA * 0.5) and rejected.grad.item() == pytest.approx(BETA * 0.5)


def test_sequence_log_probs_sum_or_average_the_masked_tokens() -> None:
    tokens = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert sequence_log_probs(tokens, mask).tolist() == [-3.0, -4.0]
    assert sequence_log_probs(tokens, mask, average=True).tolist() == [-1.5, -4.0]


def test_ranking_accuracy_counts_a_tie_half() -> None:
    assert ranking_accuracy(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0])).item() == 0.5


def test_the_objective_reads_interleaved_rows_as_pairs() -> None:
    policy = torch.stack([POLICY_CHOSEN, POLICY_REJECTED], dim=1).flatten()  # chosen, rejected, chosen, rejected
    reference = torch.stack([REFERENCE_CHOSEN, REFERENCE_REJECTED], dim=1).flatten()
    loss, metrics = pair_objective(policy, reference, PreferenceLossArguments(beta=BETA))
    assert loss.item() == pytest.approx((0.3132617 + 0.9740770) / 2, abs=1e-6)
    assert metrics["rewards/margin"].item() == pytest.approx((1.0 - 0.5) / 2)
    assert metrics["rewards/accuracy"].item() == 0.5


def test_built_in_pairs_prefer_the_correct_answer_over_a_near_miss() -> None:
    train, held_out = arithmetic_problems()
    wrong = wrong_answers(train)
    assert wrong == wrong_answers(train)  # seeded: the same pairs every run
    offsets = {int(w) - int(p.answer) for p, w in zip(train, wrong, strict=True)}
    assert 0 not in offsets and offsets <= set(range(-5, 6))
    tokenizer = load_tokenizer("tiny://qwen2")
    pairs, eval_pairs = load_preference_splits(PreferenceDataArguments(apply_chat_template=False), tokenizer, 6)
    assert len(pairs) == len(train) and len(eval_pairs) == len(held_out)
    first = pairs[0]
    assert first.chosen.prompt == first.rejected.prompt == train[0].prompt
    assert tokenizer.decode(first.chosen.response_ids, skip_special_tokens=True) == train[0].answer
    assert tokenizer.decode(first.rejected.response_ids, skip_special_tokens=True) == wrong[0]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_pairs_from_a_file_by_column_and_in_one_batch(tmp_path: Path) -> None:
    # Prompts as conversations, chosen responses as text, rejected ones as assistant turns.
    rows = [
        {"question": [{"role": "user", "content": q}], "good": good, "bad": [{"role": "assistant", "content": bad}]}
        for q, good, bad in (("1+1=", "2", "3"), ("2+2=", "4", "55"))
    ]
    files = write_jsonl(tmp_path / "pairs.jsonl", rows)
    data = PreferenceDataArguments(
        train_file=files, eval_file=files, prompt_key="question", chosen_key="good", rejected_key="bad"
    )
    data.apply_chat_template = False
    tokenizer = load_tokenizer("tiny://qwen2")
    train, _ = load_preference_splits(data, tokenizer, max_response_length=4)
    batch = encode_pairs(train, pad_id=tokenizer.pad_token_id)
    responses = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    assert responses == ["2", "3", "4", "55"]  # chosen at even rows, rejected at odd rows
    assert batch.batch["input_ids"].shape[0] == 4 and batch.batch["response_mask"].sum(-1).tolist() == [2, 2, 2, 3]
    data.too_long = "error"
    with pytest.raises(ConfigError, match="demonstrations longer than max_response_length=2"):
        load_preference_splits(data, tokenizer, max_response_length=2)
    with pytest.raises(ConfigError, match=r"no column 'rejected' \(data.rejected_key\)"):
        load_preference_splits(
            PreferenceDataArguments(train_file=files, eval_file=files, prompt_key="question", chosen_key="good"),
            tokenizer,
            4,
        )


def test_a_prompt_ending_with_the_answer_is_refused(tmp_path: Path) -> None:
    turns = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    files = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": turns, "chosen": "2", "rejected": "3"}])
    data = PreferenceDataArguments(train_file=files, eval_file=files)
    with pytest.raises(ConfigError, match="ends with an assistant turn"):
        load_preference_splits(data, load_tokenizer("tiny://qwen2"), 4)


def dpo(*overrides: str) -> DPOConfig:
    cfg = compose_config("dpo_arithmetic", ["platform=cpu", "devices_per_node=2", "pretrain=tiny://qwen2", *overrides])
    return load_pipeline_config(cfg, DPOConfig, yaml_names([CONFIG_DIR]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor_train.training_args.per_device_train_batch_size=15", "batch_size=15"], "must be even"),
        (["batch_size=16"], "batch_size=16 pairs are 32 rows, which must equal"),
        (["actor_train.max_tokens_per_microbatch=512"], "actor_train.max_tokens_per_microbatch must be null"),
        (["loss.loss_type=ipo", "loss.label_smoothing=0.1"], "loss.label_smoothing=0.1 applies to loss.loss_type"),
        (["loss.kto_desirable_weight=2"], "loss.kto_desirable_weight=2.0 applies to loss.loss_type=kto only"),
        (
            ["actor_train.strategy_args.strategy_name=hf_infer", "actor_train.strategy_args.strategy_config={}"],
            "actor_train.strategy_args.strategy_name=hf_infer does not train",
        ),
        (["pretrain=/no/such/sft/model"], "pretrain='/no/such/sft/model' does not exist"),
        (["resume_from_checkpoint=latest"], "resume_from_checkpoint='latest'"),
        (["batch_size=1000", "actor_train.training_args.per_device_train_batch_size=1000"], "batch_size=1000 is more"),
    ],
)
def test_relations_are_one_line_errors_naming_the_field(overrides: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        dpo(f"output_dir={tmp_path}", *overrides)
    assert "\n" not in str(error.value)


def test_the_example_yaml_validates_and_plans_pairs() -> None:
    config = dpo()
    assert config.actor_train.worker_cls.endswith("DPOWorker") and config.reference.dp_size == 2
    assert config.batch_plan()[0] == "pairs: 32 per optimizer step = 64 rows (chosen and rejected side by side)"
