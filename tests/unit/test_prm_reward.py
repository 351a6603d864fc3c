"""A process reward model as RLVR's reward: steps found in generated responses, step rewards on their end tokens and
the min / last aggregates by hand, the advantages they feed, the two-step prompts and the config checks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll.algorithms.process_reward_losses import step_rewards
from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.data_config import DataArguments, PreferenceDataArguments
from roll.configs.schema import ConfigError
from roll.datasets.prompt_dataset import load_splits
from roll.datasets.step_dataset import load_step_splits, response_step_ends
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import load_tokenizer
from roll.pipeline.base.reward_model_worker import ProcessRewardScoringWorker, step_end_mask
from roll.pipeline.rlvr.rlvr_config import PROCESS_REWARD_SCORING_WORKER, REWARD_MODEL_WORKER
from roll.pipeline.rlvr.rollout import compute_advantages
from tests.unit.test_rm import rlvr_with_reward_model, write_model_config

# Logits at four response tokens of three responses; the first two have steps ending at tokens 1 and 3 (the first
# step's probability 0.2689 then 0.8808, the second's the other way round), the third none.
SCORES = torch.tensor([[3.0, -1.0, 4.0, 2.0], [0.0, 2.0, 0.0, -1.0], [1.0, 1.0, 1.0, 1.0]])
MASK = torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1], [0, 0, 0, 0]])
LOW, HIGH = 0.26894142, 0.88079708  # sigmoid(-1), sigmoid(2)


def test_step_rewards_sit_on_the_step_end_tokens_and_move_the_running_min() -> None:
    # The first step sets the min; the second keeps it (0) or lowers it (LOW - HIGH). Each row sums to its min.
    expected = torch.tensor([[0.0, LOW, 0.0, 0.0], [0.0, HIGH, 0.0, LOW - HIGH], [0.0, 0.0, 0.0, 0.0]])
    rewards = step_rewards(SCORES, MASK, "min")
    torch.testing.assert_close(rewards, expected)
    torch.testing.assert_close(rewards.sum(-1), torch.tensor([LOW, LOW, 0.0]))


def test_step_rewards_move_the_last_step_probability() -> None:
    expected = torch.tensor([[0.0, LOW, 0.0, HIGH - LOW], [0.0, HIGH, 0.0, LOW - HIGH], [0.0, 0.0, 0.0, 0.0]])
    rewards = step_rewards(SCORES, MASK, "last")
    torch.testing.assert_close(rewards, expected)
    torch.testing.assert_close(rewards.sum(-1), torch.tensor([HIGH, LOW, 0.0]))


@pytest.mark.parametrize(
    ("ids", "separator", "ends"),
    [
        ([5, 67, 6, 67], [67], [1, 3]),
        ([5, 67, 6], [67], [1, 2]),  # a last step without its separator ends at the last token
        ([67, 67], [67], [0, 1]),
        ([], [67], []),
        ([1, 8, 9, 8, 9, 2], [8, 9], [2, 4, 5]),  # a separator of two tokens: its last one
    ],
)
def test_steps_of_a_generated_response_end_at_each_separator(
    ids: list[int], separator: list[int], ends: list[int]
) -> None:
    assert response_step_ends(ids, separator) == ends


def test_generated_responses_are_split_where_the_prm_training_data_marks_step_ends() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    train, _ = load_step_splits(PreferenceDataArguments(format="steps", apply_chat_template=False), tokenizer, 20)
    separator = tokenizer("\n", add_special_tokens=False)["input_ids"]
    for row in train[:200]:
        assert response_step_ends(row.example.response_ids, separator) == list(row.step_ends)


class _FixedScoresStrategy:
    """Runs the worker's forward function on token-classification logits of SCORES' first row at every row."""

    def forward_step(self, batch: DataProto, forward_func: Any) -> dict[str, torch.Tensor]:
        rows, width = batch.batch["input_ids"].shape
        logits = torch.zeros(rows, width, 1)
        logits[:, -4:, 0] = SCORES[0]
        return forward_func(batch, SimpleNamespace(logits=logits))[1]


@pytest.mark.parametrize(("step_rewards_on", "aggregate", "score"), [(True, "min", LOW), (False, "last", HIGH)])
def test_the_prm_worker_scores_steps_of_generated_ids_and_the_closing_eos_as_one(
    step_rewards_on: bool, aggregate: str, score: float
) -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    sep, eos = tokenizer("\n", add_special_tokens=False)["input_ids"][0], tokenizer.eos_token_id
    # `7\n9\n<eos>` cut to four tokens (steps end at 1 and 3), and a response of an EOS alone (a step: the PRM's
    # data labels the EOS, which ends a whole answer or not).
    responses = torch.tensor([[11, sep, 13, sep], [eos, 0, 0, 0]])
    batch = DataProto.from_dict(
        tensors={
            "input_ids": torch.cat([torch.full((2, 2), 7), responses], 1),
            "attention_mask": torch.ones(2, 6, dtype=torch.long),
            "responses": responses,
            "response_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]),
        }
    )
    config = SimpleNamespace(step_separator="\n", step_rewards=step_rewards_on, step_aggregate=aggregate, name="r")
    worker = SimpleNamespace(
        strategy=_FixedScoresStrategy(), tokenizer=tokenizer, worker_config=config, compute_seconds=0.0
    )
    out = ProcessRewardScoringWorker.compute_rewards(worker, batch).batch
    closing = torch.sigmoid(SCORES[0, 0]).item()
    assert out["scores"].tolist() == pytest.approx([score, closing])
    assert out["reward_failed"].tolist() == [0.0, 0.0]
    if step_rewards_on:
        torch.testing.assert_close(out["turn_rewards"][0], step_rewards(SCORES[:1], MASK[:1], aggregate)[0])
        assert (
            out["turn_rewards"][1].tolist() == pytest.approx([closing, 0, 0, 0]) and out["turn_discounts"].eq(1).all()
        )
    else:
        assert "turn_rewards" not in out
    assert step_end_mask(torch.tensor([[11, sep, eos, 0]]), torch.tensor([3]), [sep]).tolist() == [[0, 1, 1, 0]]


def test_token_level_estimators_credit_each_step_and_outcome_estimators_read_the_aggregate() -> None:
    rewards = step_rewards(SCORES[:2], MASK[:2], "min")
    batch = DataProto.from_dict(
        tensors={
            "scores": rewards.sum(-1),
            "turn_rewards": rewards,
            "turn_discounts": torch.ones_like(rewards),
            "response_mask": torch.ones(2, 4, dtype=torch.long),
        }
    )
    group = torch.tensor([0, 0])
    token_level = AlgorithmArguments(adv_estimator="reinforce_plus_plus")
    out, _ = compute_advantages(batch, group, token_level, 0.0)
    torch.testing.assert_close(out.batch["token_rewards"], rewards)
    # Returns to go (gamma 1): the min from the start; after the second response's first step, only its drop.
    expected = torch.tensor([[LOW, LOW, 0.0, 0.0], [LOW, LOW, LOW - HIGH, LOW - HIGH]])
    torch.testing.assert_close(out.batch["returns"], expected)
    out, _ = compute_advantages(batch, group, AlgorithmArguments(adv_estimator="grpo"), 0.0)
    assert out.batch["token_rewards"][1].tolist() == pytest.approx([0.0, 0.0, 0.0, LOW])  # the min, at the end


def test_the_two_step_task_prompts_a_sum_of_three_and_demonstrates_both_steps() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    data = DataArguments(task="two_step_arithmetic", apply_chat_template=False)
    train, held_out = load_splits(data, tokenizer, 24)
    assert len(train) == 640 and len(held_out) == 160
    for example in train[:50]:
        expression, third = example.prompt[:-1].rsplit("+", 1)
        partial = eval(expression)
        assert example.answer == str(partial + int(third))
        worked = tokenizer.decode(example.response_ids, skip_special_tokens=True)
        assert worked == f"{expression}={partial}\n{partial}+{third}={example.answer}\n"


def prm_rlvr(tmp_path: Path, model: str, *overrides: str) -> Any:
    return rlvr_with_reward_model(
        tmp_path,
        f"rewards.math.worker_cls={PROCESS_REWARD_SCORING_WORKER}",
        f"rewards.math.model_args.model_name_or_path={model}",
        "rewards.math.strategy_args.strategy_name=hf_infer",
        *overrides,
    )


@pytest.fixture
def prm_dir(tmp_path: Path) -> str:
    path = write_model_config(tmp_path / "prm", ["Qwen2ForTokenClassification"], 1)
    tokenizer = load_tokenizer("tiny://qwen2")
    tokenizer.save_pretrained(path)
    return path


def test_a_prm_export_passes_with_step_rewards_or_with_its_aggregate(tmp_path: Path, prm_dir: str) -> None:
    config = prm_rlvr(tmp_path, prm_dir, "algorithm.adv_estimator=reinforce_plus_plus")
    assert config.rewards["math"].step_rewards and config.rewards["math"].step_aggregate == "min"
    lines = config.batch_plan()
    assert lines[-1].endswith(
        "split into steps at '\\n'; the process reward model gives each step's reward on its "
        "last token (score: min step)"
    )
    # grpo reads the score, which the step rewards sum to.
    prm_rlvr(tmp_path, prm_dir, "rewards.math.step_rewards=false", "rewards.math.step_aggregate=last")
    prm_rlvr(tmp_path, prm_dir)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.adv_estimator=reinforce_plus_plus", "+rewards.code.domains=[code]"],
            r"rewards\.math\.step_rewards=true gives per-step rewards, which the scores of rewards\.code cannot join",
        ),
        (["rewards.math.step_aggregate=mean"], r"rewards\.math\.step_aggregate"),
    ],
)
def test_rlvr_refuses_step_rewards_it_cannot_join_and_unknown_aggregates(
    overrides: list[str], message: str, tmp_path: Path, prm_dir: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        prm_rlvr(tmp_path, prm_dir, *overrides)


def test_each_reward_model_worker_refuses_the_other_kind_of_export_naming_the_fix(tmp_path: Path, prm_dir: str) -> None:
    outcome = write_model_config(tmp_path / "rm", ["Qwen2ForSequenceClassification"], 1)
    with pytest.raises(
        ConfigError,
        match=rf"model_name_or_path='{outcome}' is not a process reward model: .* not a \*ForTokenClassification "
        rf"with 1 label; .*rm_prm_arithmetic.* or set the cluster's worker_cls to {REWARD_MODEL_WORKER}",
    ):
        prm_rlvr(tmp_path, outcome, "algorithm.adv_estimator=reinforce_plus_plus")
    with pytest.raises(ConfigError, match=rf"worker_cls to {PROCESS_REWARD_SCORING_WORKER}"):
        rlvr_with_reward_model(
            tmp_path,
            f"rewards.math.model_args.model_name_or_path={prm_dir}",
            "rewards.math.strategy_args.strategy_name=hf_infer",
        )
