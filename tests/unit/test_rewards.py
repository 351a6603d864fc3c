"""The built-in rewards (GSM8K and MATH answers, format markup, code test cases) and their weighted sum."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from roll.configs.schema import ConfigError
from roll.rewards.code import code_reward, extract_code, parse_test_cases
from roll.rewards.functions import (
    RewardFunction,
    answer_tag_format_reward,
    boxed_format_reward,
    final_answer,
    format_reward_for,
    gsm8k_format_reward,
    math_reward,
    think_answer_format_reward,
)
from roll.rewards.reward_process import RewardFunctionError, Scorer
from tests.unit.test_config_validation import rlvr

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"
MATH_ANSWER = r"Halving gives $x = \frac{1}{2}$, so the answer is $\boxed{\frac{1}{2}}$."


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("She sold 24 then 48, 72 in all.\n#### 72", GSM8K_ANSWER, 1.0),
        ("#### 1,234", "#### 1234", 1.0),
        ("72 clips, not 5 #### 70", GSM8K_ANSWER, 0.0),  # the number after #### counts, not the last one seen
        ("<think>48 + 24</think><answer>72</answer>", GSM8K_ANSWER, 1.0),
        ("<answer>0.5</answer>", MATH_ANSWER, 1.0),
        (r"so $\boxed{0.5}$ and then 3", MATH_ANSWER, 1.0),
        (r"$\boxed{\frac{2}{4}}$", "1/2", 1.0),
        (r"$\boxed{\frac{1}{3}}$", MATH_ANSWER, 0.0),
        ("no answer here", MATH_ANSWER, 0.0),
    ],
)
def test_math_reward_reads_gsm8k_and_math_answers(response: str, answer: str, expected: float) -> None:
    assert math_reward("", response, answer) == expected


@pytest.mark.parametrize(
    ("reward", "good", "bad"),
    [
        (answer_tag_format_reward, "I add them. <answer>72</answer>", "<answer>72</answer> and more text"),
        (answer_tag_format_reward, "<answer> 72 </answer>\n", "<answer></answer>"),
        (think_answer_format_reward, "<think>48+24</think>\n<answer>72</answer>", "<answer>72</answer>"),
        (boxed_format_reward, r"So $\boxed{72}$.", "So 72."),
        (gsm8k_format_reward, "48 + 24 = 72\n#### 72", "#### seventy-two"),
        (format_reward_for(r"Answer: \d+"), "Answer: 72", "answer: 72"),
    ],
)
def test_format_rewards(reward: RewardFunction, good: str, bad: str) -> None:
    assert reward("", good, "") == 1.0
    assert reward("", bad, "") == 0.0


ADD = "```python\ndef add(a, b):\n    return a + b\n```"
ECHO_SUM = "Read two numbers:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def test_code_reward_passes_and_fails_test_cases() -> None:
    asserts = json.dumps({"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]})
    assert code_reward("", ADD, asserts) == pytest.approx(2 / 3)
    stdio = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10"]})
    assert code_reward("", ECHO_SUM, stdio) == 1.0
    assert code_reward("", "print(3)", stdio) == 0.5
    assert code_reward("", "syntax error(", stdio) == 0.0
    assert extract_code("text only") == "text only"
    with pytest.raises(ValueError, match="code test cases are"):
        parse_test_cases("3")


def test_weighted_rewards_sum_and_a_failing_function_fails_the_sample() -> None:
    fns = ["roll.rewards.functions.math_reward", "roll.rewards.functions.answer_tag_format_reward"]
    scorer = Scorer(multiprocessing.get_context("forkserver"), fns, [1.0, 0.25])
    try:
        samples = [("", "<answer>72</answer>", "#### 72"), ("", "<answer>7</answer>", "#### 72"), ("", "72", "#### 72")]
        assert scorer.score_all(samples, timeout_s=30) == [1.25, 0.25, 1.0]
    finally:
        scorer.close()
    code = Scorer(multiprocessing.get_context("forkserver"), ["roll.rewards.code.code_reward"])
    try:
        [failed] = code.score_all([("", ADD, "not json")], timeout_s=30)
        assert isinstance(failed, RewardFunctionError)
        assert "code_reward: ValueError: the answer of a code sample" in str(failed)
    finally:
        code.close()


def test_reward_config_lists_functions_and_weights() -> None:
    config = rlvr(
        "rewards.math.reward_fn=[roll.rewards.functions.math_reward,roll.rewards.functions.boxed_format_reward]",
        "rewards.math.reward_weights=[1.0,0.1]",
    )
    assert config.rewards["math"].reward_fns[1] == "roll.rewards.functions.boxed_format_reward"
    with pytest.raises(ConfigError, match=r"^rewards.math.reward_weights has 2 weights for 1 reward_fn entries"):
        rlvr("rewards.math.reward_fn=[roll.rewards.functions.math_reward]", "rewards.math.reward_weights=[1,2]")
    with pytest.raises(ConfigError, match=r"rewards.math.reward_fn\[1\]='x' is not a dotted import path"):
        rlvr("rewards.math.reward_fn=[roll.rewards.functions.math_reward,x]")


@pytest.mark.parametrize(
    ("response", "answer"),
    [("12", "12"), ("12", "13"), (" 007\n", "7"), ("-3", "-3"), ("+4", "4"), ("-0", "0"), ("12", "#### 12")],
)
def test_bare_integers_score_as_math_verify_scores_them(response: str, answer: str) -> None:
    from math_verify import parse, verify

    expected = 1.0 if verify(parse(final_answer(answer)), parse(final_answer(response))) else 0.0
    assert math_reward("", response, answer) == expected
