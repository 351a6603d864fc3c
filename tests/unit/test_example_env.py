"""The bring-your-own example (examples/envs/unit_conversion.py): built by its dotted path with its recipe's kwargs,
reset, stepped with a tool call and an answer, and its tool listed in the prompt within the recipe's budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from roll.envs import ToolEnv, make_env
from roll.models.tiny import build_char_tokenizer
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.observations import ObservationEncoder

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "examples" / "config" / "agentic_unit_conversion.yaml"))


@pytest.fixture(autouse=True)
def example_envs_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples" / "envs"))  # as PYTHONPATH=examples/envs does


def build() -> Any:
    env = make_env(RECIPE["env"]["name"], RECIPE["env"]["kwargs"])
    assert isinstance(env, ToolEnv)
    return env


def call(query: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'convert', 'arguments': {'query': query}})}</tool_call>"


def test_an_episode_with_a_tool_call_and_an_answer() -> None:
    env = build()
    question, _ = env.reset(seed=3)
    assert env.reset(seed=3)[0] == question  # the seed fixes the question
    amount, source = question.removeprefix("how many ").removesuffix("?").split(" are ")[1].split()
    target = question.split()[2]
    observation, reward, terminated, truncated, info = env.step(call(f"{amount} {source} to {target}"))
    value = observation.split()[0]
    assert observation == f"{value} {target}" and int(value) > int(amount)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert (info["tool_calls"], info["tool_successes"], info["observation_role"]) == (1, 1, "tool")
    assert env.step(f"<convert {amount} {source} to {target}>")[0] == observation  # the bracket form
    assert env.step(f"it is {value}") == ("correct", 1.0, True, False, {"success": 1.0, **_no_calls()})
    env.reset(seed=3)
    assert env.step("it is 1")[:3] == ("wrong", 0.0, True)


def _no_calls() -> dict[str, int]:
    return {"tool_calls": 0, "tool_successes": 0}


@pytest.mark.parametrize(
    ("action", "answer"),
    [
        (call("3 kg to m"), "error: cannot convert mass to length"),
        (call("3 parsecs to m"), "error: unknown unit"),
        (call("three km"), "error: ask as '<amount> <unit> to <unit>'"),
        ('<tool_call>{"name": "convert", "arguments": {query: 1}}</tool_call>', "error: malformed tool call"),
    ],
)
def test_bad_calls_are_answered_with_an_error(action: str, answer: str) -> None:
    env = build()
    env.reset(seed=0)
    observation, reward, terminated, _, info = env.step(action)
    assert observation.startswith(answer) and (reward, terminated, info["tool_successes"]) == (0.0, False, 0)


def test_no_number_is_an_invalid_answer_until_the_turns_run_out() -> None:
    env = build()
    env.reset(seed=0)
    assert env.step("no idea")[1:4] == (0.0, False, False)
    assert env.step("still none")[3] is True  # max_turns=2 answers


def test_the_recipes_prompt_lists_the_tool_within_its_budget() -> None:
    block = RECIPE["env"]
    args = EnvArguments(
        name=block["name"],
        kwargs=block["kwargs"],
        apply_chat_template=True,
        max_observation_tokens=block["max_observation_tokens"],
    )
    tiny = build_char_tokenizer()
    args.check_chat_template(tiny, "tiny://qwen2")  # renders, and the listing fits max_observation_tokens
    [schema] = args.tool_schemas()
    assert schema["function"]["name"] == "convert" and "7 km to m" in schema["function"]["description"]
    prompt = tiny.decode(ObservationEncoder(tiny, True, [schema]).first(build().reset(seed=0)[0]))
    assert '"name": "convert"' in prompt.replace("<unk>", "") and prompt.endswith("?\n<assistant>: ")
