"""The exported tokenizer renders an agent's conversation as the endpoint laid it out in training
(`roll/pipeline/agentic/endpoint_template.py`): a server of the export (`vllm serve`, which renders the
tokenizer's chat template) gives the served model exactly the ids the endpoint trained on."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion
from transformers import AutoTokenizer

from examples.agents.calculator_agent import CALC, SYSTEM
from roll.configs.worker_config import GeneratingArguments
from roll.models.model_providers import load_tokenizer
from roll.pipeline.agentic.agent_session import AgentSession, Sample, SessionLimits
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.chat_api import assistant_message, parse_chat_request
from roll.pipeline.agentic.endpoint_template import export_chat_template, plain_chat_template


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny character-level tokenizer the calculator demo trains with."""
    return load_tokenizer("tiny://qwen2")


def exported(tokenizer: Any, env: EnvArguments, directory: Path) -> Any:
    """The tokenizer as the RLVR export writes it for `env` (`StrategyWorker.export_hf`), loaded back."""
    saved = copy.copy(tokenizer)
    saved.chat_template = export_chat_template(env)
    saved.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def served_ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    """What vLLM's chat completions give the model: the chat template rendered with the tools (tool-call arguments
    parsed to objects first, as vLLM does), encoded without special tokens added."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(
        messages, tools=[CALC], tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_export_renders_an_agent_conversation_to_the_ids_the_endpoint_trained_on(
    tokenizer: Any, tmp_path: Path
) -> None:
    env = EnvArguments(agent="calculator_agent.calculator_agent", agent_tool_brackets="<>")
    session = AgentSession(
        "s", 0, tokenizer, False, {tokenizer.eos_token_id}, GeneratingArguments(max_new_tokens=13),
        SessionLimits(max_prompt_tokens=24, max_response_tokens=64, max_calls=3, max_new_tokens=13), ("<", ">"),
    )  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "37*48=?"}]
    prompts = []
    # The calculator agent's episode: a `calc` call, the tool's result, the answer; each sample as the engine
    # returns it (the text's ids, then the EOS it stopped on).
    for sampled in ("<calc 37*48>", "1776"):
        prepared = session.prepare(parse_chat_request({"messages": messages, "tools": [CALC]}))
        prompts.append(prepared.prompt_ids)
        ids = [*tokenizer(sampled, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        body = session.record(prepared, [Sample(ids, [0.0] * len(ids), stopped=True)])
        message = ChatCompletion.model_validate(body).choices[0].message  # as the agent reads it
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "1776"})
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"expression": "37*48"}'}
    [row] = session.trajectories()
    # One segment: the call's 13 sampled ids, the tool turn `1776\n` appended, the answer's 5 sampled ids.
    assert len(session.segments) == 1 and row.loss_mask == [1] * 13 + [0] * 5 + [1] * 5

    served = exported(tokenizer, env, tmp_path)
    assert served.chat_template == plain_chat_template(("<", ">"))
    # Each call's prompt, and the whole episode, as the export renders the agent's messages.
    assert served_ids(served, messages[:2], True) == prompts[0]
    assert served_ids(served, messages[:4], True) == prompts[1]
    assert served_ids(served, messages, False) == row.prompt_ids + row.response_ids
    assert served.decode(row.prompt_ids + row.response_ids) == "Multiply.\n37*48=?\n<calc 37*48><eos>1776\n1776<eos>"


def test_the_plain_template_writes_hermes_calls_the_endpoint_reads_back(tokenizer: Any) -> None:
    template = plain_chat_template()
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "37*48"}}}
    messages = [{"role": "user", "content": "37*48=?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    text = tokenizer.apply_chat_template(messages, tools=[CALC], tokenize=False, chat_template=template)
    turn = text.removeprefix("37*48=?\n").removesuffix(tokenizer.eos_token)
    assert turn == '<tool_call>{"name": "calc", "arguments": {"expression": "37*48"}}</tool_call>'
    request = parse_chat_request({"messages": messages[:1], "tools": [CALC]})
    read = assistant_message(turn, request, None)["tool_calls"][0]["function"]
    assert (read["name"], json.loads(read["arguments"])) == ("calc", {"expression": "37*48"})


def test_the_export_keeps_the_policys_template_unless_agents_train_in_the_plain_layout() -> None:
    assert export_chat_template(None) is None
    assert export_chat_template(EnvArguments()) is None  # environments, no agent
    agent = "calculator_agent.calculator_agent"
    assert export_chat_template(EnvArguments(agent=agent, apply_chat_template=True)) is None
    assert export_chat_template(EnvArguments(agent=agent)) == plain_chat_template()
