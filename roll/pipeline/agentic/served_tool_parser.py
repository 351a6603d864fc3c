"""A vLLM tool-call parser that reads a served model's output as roll's agent endpoint does (`chat_api`).

A policy trained through the endpoint with `env.agent_tool_brackets` writes its calls in the bracket form
(`<calc 12*34>`), which no vLLM parser reads. This file is a vLLM tool-parser plugin: served with

    vllm serve <export> --enable-auto-tool-choice --tool-call-parser roll \
        --tool-parser-plugin roll/pipeline/agentic/served_tool_parser.py

(and `ROLL_TOOL_BRACKETS=<>` in vLLM's environment for the bracket form; Hermes `<tool_call>` is read either way),
an agent gets the same tool calls and content from vLLM as from the endpoint. Non-streaming only.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

from roll.pipeline.agentic.chat_api import ChatRequest, assistant_message

BRACKETS_VARIABLE = "ROLL_TOOL_BRACKETS"


@ToolParserManager.register_module("roll")
class RollToolParser(ToolParser):
    """Hermes `<tool_call>` blocks, and the bracket form of `$ROLL_TOOL_BRACKETS`, parsed by `chat_api`."""

    supports_required_and_named = False  # `required` is parsed as `auto`, as the endpoint does

    def extract_tool_calls(self, model_output: str, request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        """The calls of requested tools in `model_output`, and the text left as content."""
        brackets = os.environ.get(BRACKETS_VARIABLE, "")
        tools: list[dict[str, Any]] = [tool.model_dump() for tool in request.tools or []]
        chat = ChatRequest(messages=[], tools=tools, tool_choice=str(request.tool_choice or "auto"))
        message = assistant_message(model_output, chat, (brackets[0], brackets[1]) if len(brackets) == 2 else None)
        calls = [
            ToolCall(id=call["id"], type="function", function=FunctionCall(**call["function"]))
            for call in message.get("tool_calls") or []
        ]
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls, content=message["content"])
