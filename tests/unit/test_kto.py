"""KTO: the loss and its reference point by hand, mismatched rows, the unpaired data and the config's checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from roll.algorithms.preference_losses import kto_loss, kto_reference_point
from roll.configs.data_config import PreferenceDataArguments
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import arithmetic_problems
from roll.datasets.prompt_dataset import Example
from roll.datasets.unpaired_dataset import (
    encode_labelled,
    load_unpaired_splits,
    mismatched_examples,
    parse_label,
    require_both_labels,
)
from roll.models.model_providers import load_tokenizer
from roll.pipeline.dpo.dpo_config import PreferenceLossArguments
from roll.pipeline.dpo.dpo_worker import kto_class_metrics, kto_objective
from tests.unit.test_dpo import dpo

BETA = 0.5
# Four rows: log-ratios log pi - log pi_ref = 1, -1, 1, -1; rows 0 and 2 desirable.
POLICY, REFERENCE = torch.tensor([-1.0, -3.0, -2.0, -4.0]), torch.tensor([-2.0, -2.0, -3.0, -3.0])
DESIRABLE = torch.tensor([True, False, True, False])
# Their mismatched rows (each prompt with another row's completion): log-ratios 1, 0.5, 0, 0.5, mean 0.5.
POLICY_MISMATCHED, REFERENCE_MISMATCHED = torch.tensor([-5.0, -4.0, -6.0, -5.0]), torch.tensor([-6.0, -4.5, -6, -5.5])


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_reference_point_is_the_mismatched_rows_mean_log_ratio_clamped_at_zero_without_gradient() -> None:
    policy = POLICY_MISMATCHED.clone().requires_grad_()
    point = kto_reference_point(policy, REFERENCE_MISMATCHED)
    assert point.item() == pytest.approx(0.5) and not point.requires_grad
    # log-ratios -1 and -2: their mean -1.5 is clamped to 0.
    assert kto_reference_point(torch.tensor([-3.0, -4.0]), torch.tensor([-2.0, -2.0])).item() == 0.0


def test_kto_loss_by_hand_with_z0_and_the_class_weights() -> None:
    policy = POLICY.clone().requires_grad_()
    z0 = kto_reference_point(POLICY_MISMATCHED, REFERENCE_MISMATCHED)
    losses, rewards = kto_loss(policy, REFERENCE, DESIRABLE, z0, BETA, desirable_weight=2.0, undesirable_weight=3.0)
    # desirable: 2 (1 - sigmoid(0.5 (1 - 0.5))); undesirable: 3 (1 - sigmoid(0.5 (0.5 - -1))).
    desirable, undesirable = 2 * (1 - sigmoid(0.25)), 3 * (1 - sigmoid(0.75))
    assert losses.tolist() == pytest.approx([desirable, undesirable, desirable, undesirable])
    assert losses.tolist() == pytest.approx([0.8756470, 0.9624639, 0.8756470, 0.9624639])
    assert rewards.tolist() == [0.5, -0.5, 0.5, -0.5] and not rewards.requires_grad
    losses.mean().backward()
    # Descent raises a desirable completion's log-prob and lowers an undesirable one's.
    assert (policy.grad[DESIRABLE] < 0).all() and (policy.grad[~DESIRABLE] > 0).all()


def test_kto_objective_reports_class_rewards_that_survive_one_class_micro_batches() -> None:
    loss_args = PreferenceLossArguments(loss_type="kto", beta=BETA, kto_desirable_weight=2.0, kto_undesirable_weight=3)
    loss, metrics = kto_objective(POLICY, REFERENCE, DESIRABLE, 0.5, loss_args)
    assert loss.item() == pytest.approx(0.9190555, abs=1e-6)
    assert metrics["kto/reference_point"].item() == 0.5
    # Two micro-batches of the step, one all desirable, one all undesirable, averaged like the strategy does.
    halves = [kto_objective(POLICY[i::2], REFERENCE[i::2], DESIRABLE[i::2], 0.5, loss_args)[1] for i in (0, 1)]
    averaged = {key: (halves[0][key].item() + halves[1][key].item()) / 2 for key in halves[0]}
    step = kto_class_metrics(averaged)
    assert step["rewards/desirable"] == pytest.approx(0.5) and step["rewards/undesirable"] == pytest.approx(-0.5)
    assert step["rewards/margin"] == pytest.approx(1.0) and step["kto/desirable_fraction"] == 0.5
    only_desirable = kto_class_metrics({key: value.item() for key, value in halves[0].items()})
    assert "rewards/undesirable" not in only_desirable and "rewards/margin" not in only_desirable


def example(prompt: str, answer: str) -> Example:
    return Example(prompt, answer, "math", [ord(c) for c in prompt], [ord(c) for c in answer])


def test_mismatched_rows_pair_each_prompt_with_another_prompts_completion() -> None:
    unique = [example(f"{i}+1=", str(i + 1)) for i in range(3)]
    assert [(e.prompt, e.answer) for e in mismatched_examples(unique)] == [("0+1=", "2"), ("1+1=", "3"), ("2+1=", "1")]
    # Pairs side by side (a prompt's two completions next to each other): shifted by 2, never the own prompt.
    pairs = [example(p, a) for p, good, bad in (("1+1=", "2", "3"), ("2+2=", "4", "5")) for a in (good, bad)]
    mismatched = mismatched_examples(pairs)
    assert [(e.prompt, e.answer) for e in mismatched] == [("1+1=", "4"), ("1+1=", "5"), ("2+2=", "2"), ("2+2=", "3")]
    assert mismatched[0].response_ids == pairs[2].response_ids and mismatched[0].prompt_ids == pairs[0].prompt_ids


def test_two_rows_swap_completions_and_one_prompt_alone_is_refused() -> None:
    two = [example("1+1=", "2"), example("2+2=", "4")]
    assert [(e.prompt, e.answer) for e in mismatched_examples(two)] == [("1+1=", "4"), ("2+2=", "2")]
    # A pair read unpaired (one prompt, two completions) and a single row: no other prompt to take a completion from.
    for rows in ([example("1+1=", "2"), example("1+1=", "3")], [example("1+1=", "2")]):
        with pytest.raises(ValueError, match=rf"the {len(rows)} row\(s\) of this batch share one prompt"):
            mismatched_examples(rows)


def own_prompt_rows(rows: list[Example], mismatched: list[Example]) -> int:
    """Mismatched rows holding a completion of their own prompt (completions told apart by their text)."""
    prompt_of = {row.answer: row.prompt for row in rows}
    return sum(prompt_of[row.answer] == row.prompt for row in mismatched)


def test_duplicate_prompts_never_take_a_completion_of_their_own_prompt(caplog: pytest.LogCaptureFixture) -> None:
    # No shift of this order pairs every row with another prompt: each leaves a "b" or an "a" row on its own prompt.
    rows = [example(p, a) for p, a in [("a=", "1"), ("a=", "2"), ("b=", "3"), ("c=", "4"), ("b=", "5")]]
    mismatched = mismatched_examples(rows)
    assert [e.prompt for e in mismatched] == [e.prompt for e in rows] and own_prompt_rows(rows, mismatched) == 0
    assert sorted(e.answer for e in mismatched) == ["1", "2", "3", "4", "5"]  # every completion used once
    # One prompt in 3 of 4 rows: only 2 rows can take another prompt's completion; the others are left out.
    dominated = [example(p, a) for p, a in [("a=", "1"), ("b=", "2"), ("a=", "3"), ("a=", "4")]]
    with caplog.at_level("WARNING"):
        mismatched = mismatched_examples(dominated)
    assert [(e.prompt, e.answer) for e in mismatched] == [("a=", "2"), ("b=", "4")]
    assert "one prompt fills 3 of the 4 rows" in caplog.text


def test_built_in_unpaired_set_labels_each_problem_once_correct_or_near_miss() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    train, held_out = load_unpaired_splits(PreferenceDataArguments(apply_chat_template=False), tokenizer, 6)
    problems, held_out_problems = arithmetic_problems()
    assert len(train) == len(problems) and len(held_out) == len(held_out_problems)
    assert len({row.example.prompt for row in train}) == len(train)  # each prompt once: no pairs to align
    for row, problem in zip(train, problems, strict=True):
        assert (row.example.answer == problem.answer) == row.desirable
        assert abs(int(row.example.answer) - int(problem.answer)) <= 5
    share = sum(row.desirable for row in train) / len(train)
    assert 0.4 < share < 0.6
    batch = encode_labelled(train[:4], tokenizer.pad_token_id)
    assert batch.batch["desirable"].tolist() == [row.desirable for row in train[:4]]
    assert tokenizer.decode(batch.batch["responses"][0], skip_special_tokens=True) == train[0].example.answer


@pytest.mark.parametrize(("value", "label"), [(1, True), (0, False), (True, True), ("false", False), (" TRUE", True)])
def test_labels_read_as_0_1_or_true_false(value: object, label: bool) -> None:
    assert parse_label(value, "row") is label


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_labelled_completions_from_a_file_and_a_bad_label_named_by_file_line_and_column(tmp_path: Path) -> None:
    rows = [
        {"question": "1+1=", "answer": "2", "ok": 1},
        {"question": [{"role": "user", "content": "2+2="}], "answer": "5", "ok": "false"},
    ]
    files = write_jsonl(tmp_path / "kto.jsonl", rows)
    data = PreferenceDataArguments(
        train_file=files, eval_file=files, prompt_key="question", completion_key="answer", label_key="ok"
    )
    data.apply_chat_template = False
    tokenizer = load_tokenizer("tiny://qwen2")
    train, _ = load_unpaired_splits(data, tokenizer, 4)
    assert [(row.example.answer, row.desirable) for row in train] == [("2", True), ("5", False)]
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows, {"question": "3+3=", "answer": "6", "ok": "yes"}])
    data.train_file = bad
    message = rf"^data.train_file='{bad}' line 3: column 'ok' \(data.label_key\) holds 'yes', not a label"
    with pytest.raises(ConfigError, match=message):
        load_unpaired_splits(data, tokenizer, 4)


def test_held_out_rows_of_one_label_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"the 2 rows of data\.eval_file='x' are all undesirable"):
        require_both_labels(torch.tensor([False, False]), "data.eval_file='x'")
    require_both_labels(torch.tensor([False, True]), "data.eval_file='x'")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.format=unpaired"],
            "data.format=unpaired has no pairs for loss.loss_type=sigmoid; set loss.loss_type=kto",
        ),
        (["loss.loss_type=kto", "loss.label_smoothing=0.1"], "loss.label_smoothing=0.1 applies to loss.loss_type=sigm"),
        (
            ["loss.loss_type=kto", "batch_size=1"],
            "batch_size=1 with loss.loss_type=kto: .* one pair has a single prompt",
        ),
        (
            ["loss.loss_type=kto", "data.format=unpaired", "batch_size=1"],
            "batch_size=1 with loss.loss_type=kto: .* one labelled completion has a single prompt; set batch_size to 2",
        ),
        (["loss.loss_type=kto", "data.format=unpaired", "data.chosen_key=good"], "data.chosen_key='good' applies to"),
        (["data.label_key=ok"], "data.label_key='ok' applies to data.format=unpaired only, not pairs"),
        (["data.format=steps"], "data.format=steps trains a process reward model"),
        (
            ["loss.loss_type=kto", "data.format=unpaired"],
            "batch_size=32 labelled completions are 32 rows, which must equal actor_train per_device_train_batch_size",
        ),
    ],
)
def test_kto_config_errors_name_the_field(overrides: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        dpo(f"output_dir={tmp_path}", *overrides)


def test_unpaired_kto_plans_rows_and_the_mismatched_rows() -> None:
    config = dpo(
        "loss.loss_type=kto",
        "data.format=unpaired",
        "batch_size=30",
        "actor_train.training_args.per_device_train_batch_size=15",  # odd: a micro-batch need not hold pairs
    )
    plan = config.batch_plan()
    assert plan[0] == "labelled completions: 30 per optimizer step = 30 rows"
    assert plan[2].startswith("reference: 30 rows per rank on 2 rank(s)")  # the rows and their mismatched rows
    assert plan[3].startswith("kto reference point: 30 mismatched rows")


def test_held_out_completions_of_one_label_are_refused_in_validation(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1), "label": i % 2} for i in range(40)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [row for row in rows if not row["label"]])
    kto = ["loss.loss_type=kto", "data.format=unpaired", "batch_size=30", "data.apply_chat_template=false"]
    kto.append("actor_train.training_args.per_device_train_batch_size=15")
    files = [f"data.train_file={train}", f"data.eval_file={held_out}"]
    message = rf"^the 20 rows of data.eval_file='{held_out}' \(eval_batch_size=0\) are all undesirable"
    with pytest.raises(ConfigError, match=message):
        dpo(f"output_dir={tmp_path}", *kto, *files)
