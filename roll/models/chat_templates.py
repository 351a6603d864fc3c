"""Chat templates written in code: the tiny models' template and a Qwen2.5-style one, both rendering `tools`.

A tokenizer's `apply_chat_template(messages, tools=[schema, ...])` hands the tools' function schemas (the OpenAI
format `{"type": "function", "function": {"name", "description", "parameters"}}`, what
`roll.envs.tools.Tool.schema()` returns) to its template. Both templates here render them the way Qwen2.5 and
Hermes models are taught to read them: a system section listing each schema as JSON inside `<tools></tools>`, and
the call convention `<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>`, which
`roll.envs.tool_calls` parses from the model's output (format `hermes`).

- `TINY_CHAT_TEMPLATE` is the template of `roll.models.tiny`'s tokenizers: `<role>: content` lines, the
  assistant's followed by its EOS, and the tools section as a first `<system>: ` turn when tools are given
  (worded briefly: a character-level tokenizer spends one token per character). Without tools it renders
  exactly as before tools existed.
- `QWEN25_CHAT_TEMPLATE` follows Qwen2.5-Instruct's template (`<|im_start|>role ... <|im_end|>`, the default
  system prompt, assistant `tool_calls` rendered as `<tool_call>` blocks, tool results as `<tool_response>` in a
  user turn), for tests and for tokenizers built locally; nothing is downloaded.
"""

from __future__ import annotations

# The call convention both templates state.
TOOL_CALL_CONVENTION = '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'

TINY_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<system>: You may call these tools. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nCall one as " + TOOL_CALL_CONVENTION.replace('"', '\\"') + "\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>: ' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>: ' }}{% endif %}"
)

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + QWEN25_DEFAULT_SYSTEM + "' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + QWEN25_DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
