"""The chat template of the agent endpoint's plain layout, so a server of the exported model renders what was trained.

Without `env.apply_chat_template` the endpoint lays a conversation out as each system, user or tool message's
content and a newline, and each assistant turn as the policy sampled it: its text, its tool calls as the policy
writes them (the bracket form `<calc 12*34>` with `env.agent_tool_brackets`, else Hermes' `<tool_call>{...}
</tool_call>`) and the EOS token, with no generation prompt; the tools are not listed. `plain_chat_template` is that
layout as a Jinja chat template: the endpoint renders its prompts with it, and the RLVR pipeline writes it into the
exported tokenizer (`export_chat_template`), so `vllm serve` of the export renders an agent's (messages, tools) to the
ids the endpoint trained on. With `env.apply_chat_template` the endpoint renders the policy's own template, which
the export keeps.
"""

from __future__ import annotations

import json

from roll.pipeline.agentic.agentic_config import EnvArguments

# The bracket form's text is the call's first argument (`chat_api._openai_call` names it after the tool's first
# parameter); a JSON-string `arguments` is rendered as it is (vLLM and the endpoint both pass objects).
_BRACKET_CALL = (
    "{{- OPENING + function['name'] + ' ' -}}"
    "{%- if function['arguments'] is mapping -%}"
    "{%- for value in function['arguments'].values() -%}{%- if loop.first -%}{{- value -}}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{- function['arguments'] -}}{%- endif -%}"
    "{{- CLOSING -}}"
)
_HERMES_CALL = (
    "{{- '<tool_call>' + {'name': function['name'], 'arguments': function['arguments']} | tojson + '</tool_call>' -}}"
)


def plain_chat_template(brackets: tuple[str, str] | None = None) -> str:
    """The endpoint's plain layout as a Jinja chat template; tool calls in the bracket form of `brackets`, else
    Hermes'."""
    call = _HERMES_CALL
    if brackets:
        opening, closing = (json.dumps(bracket) for bracket in brackets)  # a JSON string is a Jinja string literal
        call = _BRACKET_CALL.replace("OPENING", opening).replace("CLOSING", closing)
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'assistant' -%}"
        "{{- message['content'] or '' -}}"
        "{%- for tool_call in message['tool_calls'] or [] -%}"
        "{%- set function = tool_call['function'] -%}" + call + "{%- endfor -%}"
        "{{- eos_token -}}"
        "{%- else -%}"
        "{{- (message['content'] or '') + '\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


def export_chat_template(env: EnvArguments | None) -> str | None:
    """The chat template the export's tokenizer gets: the plain layout's when agents are trained through the
    endpoint without `env.apply_chat_template`; None (the policy's own) otherwise."""
    if env is None or env.apply_chat_template:
        return None
    agents = [block for block in env.source_envs().values() if block.agent]
    if not agents:
        return None
    brackets = agents[0].agent_tool_brackets
    return plain_chat_template((brackets[0], brackets[1]) if brackets else None)
