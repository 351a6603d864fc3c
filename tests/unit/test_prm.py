"""Process reward model: the step loss and metrics by hand, the step data (built-in and files), scoring, config."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from roll.algorithms.process_reward_losses import first_error_found, step_accuracy, step_bce_loss
from roll.configs.data_config import PreferenceDataArguments
from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.configs.worker_config import ModelArguments
from roll.datasets.arithmetic import OPERATIONS, arithmetic_problems
from roll.datasets.step_dataset import (
    GARBAGE_CHARACTERS,
    WRONG_KINDS,
    arithmetic_step_table,
    encode_steps,
    load_step_splits,
)
from roll.models.model_providers import load_model, load_tokenizer
from roll.pipeline.rm.prm_worker import process_objective, response_scores
from roll.pipeline.rm.rm_config import RMConfig
from tests.conftest import CONFIG_DIR
from tests.unit.test_hydra_configs import compose_config

# Two responses of four tokens; steps end at tokens 1 and 3 of the first, token 0 of the second.
SCORES = torch.tensor([[2.0, 5.0, 0.0, -1.0], [1.0, -3.0, 7.0, 0.0]])
MASK = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0]])
LABELS = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_step_loss_by_hand_reads_only_the_step_ends() -> None:
    scores = SCORES.clone().requires_grad_()
    loss = step_bce_loss(scores, LABELS, MASK)
    # -log sigmoid(5) (label 1), -log(1 - sigmoid(-1)) and -log(1 - sigmoid(1)) (label 0), averaged over 3 steps.
    expected = (softplus(-5.0) + softplus(-1.0) + softplus(1.0)) / 3
    assert loss.item() == pytest.approx(expected) and loss.item() == pytest.approx(0.5444129)
    loss.backward()
    assert (scores.grad[MASK == 0] == 0).all() and (scores.grad[MASK == 1] != 0).all()
    assert scores.grad[0, 1] < 0 and scores.grad[0, 3] > 0  # descent raises a correct step, lowers a wrong one


def test_step_accuracy_and_first_error_found_by_hand() -> None:
    # Called correct: (0,1) yes (right), (0,3) no (right), (1,0) yes (wrong): 2 of 3.
    assert step_accuracy(SCORES, LABELS, MASK).item() == pytest.approx(2 / 3)
    # Both responses have a wrong step; the first found it (token 3), the second called its only step correct.
    assert first_error_found(SCORES, LABELS, MASK).item() == 0.5
    # A response called wrong too early (at its first, correct step) has not found its first error.
    assert first_error_found(torch.tensor([[-1.0, 0.0, -1.0]]), torch.tensor([[1, 0, 0]]), torch.ones(1, 3)) == 0
    assert math.isnan(first_error_found(SCORES, torch.ones_like(LABELS), MASK).item())  # no response with one


def test_process_objective_reports_step_accuracy_and_the_mean_step_score() -> None:
    loss, metrics = process_objective(SCORES, LABELS, MASK)
    assert loss.item() == pytest.approx(0.5444129, abs=1e-6)
    assert metrics["step_accuracy"].item() == pytest.approx(2 / 3)
    assert metrics["step_score"].item() == pytest.approx((5.0 - 1.0 + 1.0) / 3)


def test_built_in_steps_answer_each_prompt_right_and_wrong_and_close_with_a_labelled_eos() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    data = PreferenceDataArguments(format="steps", apply_chat_template=False)
    train, held_out = load_step_splits(data, tokenizer, 32)
    assert len(train) == 8 * 640 and len(held_out) == 8 * 160
    assert {p.example.prompt for p in train}.isdisjoint({p.example.prompt for p in held_out})
    for right, wrong in zip(train[0::2], train[1::2], strict=True):
        assert right.example.prompt == wrong.example.prompt and right.labels == (True, True, True)
        assert wrong.labels[-1] is False and list(wrong.labels) == sorted(wrong.labels, reverse=True)
        expression, third = right.example.prompt[:-1].rsplit("+", 1)
        assert (
            right.example.answer
            == f"{expression}={eval(expression)}\n{eval(expression)}+{third}={eval(expression) + int(third)}\n"
        )
    batch = encode_steps(train[:2], tokenizer.pad_token_id).batch
    separator = tokenizer("\n", add_special_tokens=False)["input_ids"][-1]
    ends = (batch["responses"] == separator) | (batch["responses"] == tokenizer.eos_token_id)
    assert (ends == batch["step_mask"].bool()).all()  # scored at separators and the closing EOS only
    assert batch["step_labels"][0][batch["step_mask"][0].bool()].tolist() == [1.0, 1.0, 1.0]


def test_built_in_wrong_answers_are_of_every_kind_and_wrong_from_their_first_wrong_step() -> None:
    rows = arithmetic_step_table(arithmetic_problems()[0], seed=0).to_list()
    wrong = [row for row in rows if row["kind"]]
    assert len(wrong) == len(rows) / 2 and not any(row["complete"] for row in wrong)
    shares = Counter(row["kind"] for row in wrong)
    assert set(shares) == set(WRONG_KINDS) and 0.4 < shares["off_by"] / len(wrong) < 0.6

    def right(step: str) -> bool:  # an equation `x op y=z` that holds
        match = re.fullmatch(r"(-?\d+)([+-])(\d+)=(-?\d+)", step)
        return bool(match) and OPERATIONS[match[2]](int(match[1]), int(match[3])) == int(match[4])

    for row in wrong:
        prompt, steps, labels = row["messages"][0]["content"], row["steps"], row["labels"]
        first_wrong = labels.index(False) if False in labels else len(labels)
        assert labels == [True] * first_wrong + [False] * (len(steps) - first_wrong)
        expression, third = prompt[:-1].rsplit("+", 1)
        assert steps[0].startswith(f"{expression}=") or first_wrong == 0
        kind = row["kind"]
        if kind == "off_by":
            assert len(steps) == 2 and not right(steps[first_wrong]) and first_wrong < 2
        elif kind == "operands":  # right arithmetic, but not on the prompt's numbers
            expected = [f"{expression}=", f"{steps[0].split('=')[1]}+{third}="]
            assert right(steps[first_wrong]) and not steps[first_wrong].startswith(expected[first_wrong])
        elif kind == "garbage":
            assert len(steps) == first_wrong + 1 and not right(steps[-1]) and set(steps[-1]) <= set(GARBAGE_CHARACTERS)
        elif kind == "truncated":
            partial = eval(expression)
            whole = [f"{expression}={partial}", f"{partial}+{third}={partial + int(third)}"][first_wrong]
            assert len(steps) == first_wrong + 1 and whole.startswith(steps[-1]) and steps[-1] != whole
        elif kind == "extra":
            assert len(steps) == 3 and first_wrong == 2 and all(right(step) for step in steps)
        else:
            assert kind == "stop" and len(steps) == 1 and labels == [True] and right(steps[0])


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_step_files_read_by_column_and_a_length_mismatch_names_file_row_and_field(tmp_path: Path) -> None:
    rows = [
        {"q": "1+2+3=", "steps": ["1+2=3", "3+3=6"], "ok": [1, "true"]},
        {"q": "2+2+2=", "steps": ["2+2=5", "5+2=7"], "ok": [0, False]},
    ]
    files = write_jsonl(tmp_path / "prm.jsonl", rows)
    data = PreferenceDataArguments(
        format="steps", train_file=files, eval_file=files, prompt_key="q", steps_key="steps", step_labels_key="ok"
    )
    data.apply_chat_template, data.step_separator = False, " ки"
    tokenizer = load_tokenizer("tiny://qwen2")
    train, _ = load_step_splits(data, tokenizer, 32)
    assert [row.labels for row in train] == [(True, True, True), (False, False, False)]  # the EOS's last
    assert train[0].example.answer == "1+2=3 ки3+3=6 ки"
    ids, eos = train[0].example.response_ids, tokenizer.eos_token_id
    assert ids[-1] == eos and [ids[end] for end in train[0].step_ends] == [ids[-2], ids[-2], eos]  # separators' ends
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows, {"q": "1+1+1=", "steps": ["1+1=2", "2+1=3"], "ok": [1]}])
    data.train_file = bad
    message = rf"^data.train_file='{bad}' line 3: data.step_labels_key='ok' holds 1 labels for the 2 steps"
    with pytest.raises(ConfigError, match=message):
        load_step_splits(data, tokenizer, 32)
    data.train_file = write_jsonl(tmp_path / "label.jsonl", [{"q": "1+1=", "steps": ["1+1=2"], "ok": ["maybe"]}])
    with pytest.raises(ConfigError, match=r"line 1: data.step_labels_key='ok' label 0 holds 'maybe', not a label"):
        load_step_splits(data, tokenizer, 32)


def test_step_scores_are_read_at_each_token_and_padding_does_not_move_them() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    model = load_model(ModelArguments(model_name_or_path="tiny://qwen2", dtype="fp32"), "value").eval()
    data = PreferenceDataArguments(format="steps", apply_chat_template=False)
    train = load_step_splits(data, tokenizer, 20)[0]
    rows = [
        next(r for r in train if len(r.example.prompt_ids) < 8),
        next(r for r in train if len(r.example.prompt_ids) > 8),
    ]
    batch = encode_steps(rows, tokenizer.pad_token_id).batch
    with torch.no_grad():
        output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        padded = response_scores(output, batch["responses"].shape[1])
        row = rows[0].example
        alone = model(input_ids=torch.tensor([[*row.prompt_ids, *row.response_ids]])).logits[
            0, -len(row.response_ids) :, 0
        ]
    assert padded[0, : len(row.response_ids)].tolist() == pytest.approx(alone.tolist(), abs=1e-4)


def rm(*overrides: str, name: str = "rm_prm_arithmetic") -> RMConfig:
    cfg = compose_config(name, ["platform=cpu", "devices_per_node=2", "pretrain=tiny://qwen2", *overrides])
    return load_pipeline_config(cfg, RMConfig, yaml_names([CONFIG_DIR]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["reward_model.worker_cls=roll.pipeline.rm.rm_worker.RewardTrainWorker"],
            "reward_model.worker_cls=roll.pipeline.rm.rm_worker.RewardTrainWorker does not train on data.format=steps",
        ),
        (["margin=1.0"], "margin=1.0 applies to data.format=pairs only, not steps"),
        (["data.format=unpaired", "data.step_separator=x"], "data.step_separator='x' applies to data.format=steps"),
        (
            ["data.format=pairs"],
            "worker_cls=roll.pipeline.rm.prm_worker.ProcessRewardTrainWorker does not train on data.format=pairs",
        ),
        (["batch_size=32"], "batch_size=32 step-labelled responses are 32 rows, which must equal reward_model"),
        (["pretrain=/no/such/rm/model"], "a process reward model starts from a trained reward model; write the RM"),
    ],
)
def test_prm_config_errors_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rm(*overrides)


def test_the_prm_yaml_validates_and_plans_rows_scored_at_separators() -> None:
    config = rm()
    assert config.reward_model.worker_cls.endswith("ProcessRewardTrainWorker") and config.data.format == "steps"
    assert config.batch_plan()[0].startswith("step-labelled responses: 64 per optimizer step = 64 rows")
    with pytest.raises(ConfigError, match=r"data\.format=unpaired .* trains with KTO"):
        rm("data.format=unpaired", name="rm_arithmetic")
