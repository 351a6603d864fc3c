"""Tools in the prompt: an environment's tool schemas reach the chat template's `tools`, and a Hermes `<tool_call>`
the model writes becomes a call of the named tool (a malformed one an error observation).

The Qwen2.5-style tokenizer is built here: the tiny character tokenizer with Qwen's turn markers as special tokens
(`<|im_end|>` its EOS) and `roll.models.chat_templates.QWEN25_CHAT_TEMPLATE`. No Ray, no model.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.envs.protocol import SUCCESS
from roll.envs.registry import register_env
from roll.envs.tools import Tool, ToolEnv
from roll.models.chat_templates import QWEN25_CHAT_TEMPLATE
from roll.models.tiny import DEFAULT_ALPHABET, build_char_tokenizer
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.multi_turn import MultiTurnRollout
from roll.pipeline.agentic.observations import ObservationEncoder

CALLS: list[str] = []  # what the lookup tool was asked, in order
CAPITALS = {"france": "paris", "peru": "lima"}


def lookup(key: str) -> str:
    CALLS.append(key)
    if key not in CAPITALS:
        raise ValueError(f"no entry for {key!r}")
    return CAPITALS[key]


LOOKUP = Tool("lookup", "country", lookup, "The capital of a country, e.g. france -> paris.")


class CapitalTask:
    """`capital of france?`: an answer naming the capital wins."""

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.country = sorted(CAPITALS)[(seed or 0) % len(CAPITALS)]
        return f"capital of {self.country}?", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        correct = CAPITALS[self.country] in action
        return ("correct" if correct else "wrong"), float(correct), True, False, {SUCCESS: float(correct)}


@register_env("test_capitals_with_lookup")
def capitals_with_lookup() -> ToolEnv:
    return ToolEnv(CapitalTask(), [LOOKUP])


@register_env("test_capitals_without_tools")
def capitals_without_tools() -> CapitalTask:
    return CapitalTask()


@pytest.fixture(scope="module")
def qwen() -> PreTrainedTokenizerFast:
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET + "{}[]|")
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    return tokenizer


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_the_environments_tool_schemas() -> None:
    [schema] = EnvArguments(name="test_capitals_with_lookup").tool_schemas()
    assert schema["function"]["name"] == "lookup"
    assert schema["function"]["parameters"]["required"] == ["country"]
    assert EnvArguments(name="test_capitals_without_tools").tool_schemas() == []


def test_the_dry_run_names_the_tools_the_prompt_lists() -> None:
    listed = EnvArguments(name="test_capitals_with_lookup", apply_chat_template=True).describe(4, 8)
    assert listed[-1] == "env test_capitals_with_lookup: tools listed in the prompt by the chat template: lookup"
    assert "tools" not in EnvArguments(name="test_capitals_with_lookup").describe(4, 8)[-1]  # no template, no listing


def test_the_first_observation_lists_the_tools_in_the_qwen25_format(qwen: PreTrainedTokenizerFast) -> None:
    tools = EnvArguments(name="test_capitals_with_lookup").tool_schemas()
    text = qwen.decode(ObservationEncoder(qwen, True, tools).first("capital of peru?"))
    system, user = text.split("<|im_end|>\n<|im_start|>user\n")
    assert system.startswith("<|im_start|>system\nYou are Qwen")
    listed = system[system.index("<tools>\n") + len("<tools>\n") : system.index("\n</tools>")]
    assert json.loads(listed) == LOOKUP.schema()  # name, description and parameters
    assert "The capital of a country" in listed and '"country": {"type": "string"}' in listed
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert user == "capital of peru?<|im_end|>\n<|im_start|>assistant\n"
    without = qwen.decode(ObservationEncoder(qwen, True).first("capital of peru?"))
    assert "<tools>" not in without and without.endswith(user)


def test_the_tiny_template_lists_the_tools_and_renders_as_before_without() -> None:
    tiny = build_char_tokenizer()
    turn = [{"role": "user", "content": "capital of peru?"}]
    text = tiny.apply_chat_template(turn, tools=[LOOKUP.schema()], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<system>: ") and text.endswith("<user>: capital of peru?\n<assistant>: ")
    assert f"<tools>\n{json.dumps(LOOKUP.schema())}\n</tools>" in text and "<tool_call>{" in text
    assert tiny.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) == (
        "<user>: capital of peru?\n<assistant>: "
    )


class ScriptedModel:
    """Stand-in for actor_infer: each call returns the next scripted action (its ids and EOS) for every episode."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, actions: list[str]) -> None:
        self.tokenizer, self.actions, self.prompts = tokenizer, list(actions), []

    def generate(self, request: DataProto, args: GeneratingArguments) -> DataProto:
        ids, mask = request.batch["input_ids"], request.batch["attention_mask"].bool()
        self.prompts.append([self.tokenizer.decode(row[keep]) for row, keep in zip(ids, mask, strict=True)])
        sampled = self.tokenizer(self.actions.pop(0), add_special_tokens=False)["input_ids"]
        sampled.append(self.tokenizer.eos_token_id)
        rows, width = len(request), args.max_new_tokens
        responses = torch.zeros((rows, width), dtype=torch.long)
        responses[:, : len(sampled)] = torch.tensor(sampled)
        response_mask = (torch.arange(width) < len(sampled)).long().expand(rows, width)
        return DataProto.from_dict(tensors={"responses": responses, "response_mask": response_mask})


def play(tokenizer: PreTrainedTokenizerFast, actions: list[str]) -> tuple[DataProto, dict[str, float], ScriptedModel]:
    args = EnvArguments(
        name="test_capitals_with_lookup",
        apply_chat_template=True,
        max_turns=2,
        max_observation_tokens=1024,
        max_trajectory_tokens=512,
    )
    model = ScriptedModel(tokenizer, actions)
    rollout = MultiTurnRollout(args, tokenizer, pad_id=0)
    batch, metrics = rollout.run(model.generate, [1], GeneratingArguments(max_new_tokens=96), base_seed=0)
    rollout.close()
    return batch, metrics, model


def test_a_hermes_tool_call_in_the_output_calls_the_named_tool(qwen: PreTrainedTokenizerFast) -> None:
    CALLS.clear()
    batch, metrics, model = play(qwen, [hermes("lookup", {"country": "peru"}), "lima"])
    first, second = model.prompts[0][0], model.prompts[1][0]
    assert '"name": "lookup"' in first and first.endswith("capital of peru?<|im_end|>\n<|im_start|>assistant\n")
    assert CALLS == ["peru"]  # the named tool, with its argument
    assert second.endswith(
        "<|im_start|>user\n<tool_response>\nlima\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert second.startswith(first)  # token in, token out: the history is extended, never re-rendered
    assert metrics["rollout/tool_calls_per_episode"] == 1 and metrics["rollout/tool_success_rate"] == 1
    assert metrics["rollout/success"] == 1.0 and batch.batch["scores"].tolist() == [1.0]
    # The ids played are the conversation rendered anew with the same tools.
    assert metrics["rollout/template_drift"] == 0.0


def test_a_malformed_tool_call_is_answered_with_an_error(qwen: PreTrainedTokenizerFast) -> None:
    CALLS.clear()
    _, metrics, model = play(qwen, ['<tool_call>\n{"name": "lookup", "arguments": {country: peru}}\n</tool_call>', "x"])
    assert CALLS == []
    assert "<tool_response>\nerror: malformed tool call: invalid JSON" in model.prompts[1][0]
    assert metrics["rollout/tool_calls_per_episode"] == 1 and metrics["rollout/tool_success_rate"] == 0
    assert metrics["rollout/env_errors"] == 0  # the environment answered; nothing crashed


def test_the_tiny_template_puts_the_tools_in_the_rollouts_prompt() -> None:
    tiny = build_char_tokenizer()
    _, metrics, model = play(tiny, ["<lookup peru>", "lima"])
    assert model.prompts[0][0].startswith("<system>: You may call these tools.")
    assert metrics["rollout/template_drift"] == 0.0  # braces are <unk> both ways
    assert '"name": "lookup"' in model.prompts[0][0].replace("<unk>", "")


def test_the_config_check_of_tools_in_the_prompt(
    qwen: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    roomy = EnvArguments(name="test_capitals_with_lookup", apply_chat_template=True, max_observation_tokens=1024)
    roomy.check_chat_template(qwen, "qwen-style")
    tight = EnvArguments(name="test_capitals_with_lookup", apply_chat_template=True, max_observation_tokens=64)
    with pytest.raises(ConfigError, match=r"lists its tools \(lookup\) in \d+ tokens .*env\.max_observation_tokens=64"):
        tight.check_chat_template(qwen, "qwen-style")
    plain = build_char_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}\n{% endfor %}"
    with caplog.at_level(logging.WARNING):
        roomy.check_chat_template(plain, "plain-model")
    assert "does not render `tools`" in caplog.text and "plain-model" in caplog.text
