"""A calculator agent written with the `openai` package, as it would run against any OpenAI-compatible server.

It asks the model to multiply, offers a `calc` tool, runs the calls the model makes and gives the results back,
until the model answers without a call (or `MAX_TURNS` is reached), and returns that answer. roll trains it by
pointing its client at the rollout's endpoint (`env.agent: calculator_agent.calculator_agent`,
examples/config/agentic_calculator_agent.yaml); the same file runs unchanged against `vllm serve` of the export,
with roll's tool-call parser for the `<calc 12*34>` calls (examples/agents/score_served.py starts that server and
scores the held-out tasks; docs/agentic.md, serving the export):

    python examples/agents/calculator_agent.py --base-url http://127.0.0.1:8011/v1 "37*48=?"
"""

from __future__ import annotations

import argparse
import ast
import json
import operator

from openai import OpenAI

SYSTEM = "Multiply."
MAX_TURNS = 3
MAX_TOKENS = 13
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate arithmetic such as 12*34.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expression: str) -> str:
    """The value of `expression` (numbers and + - * /), or an error message the model reads."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * /")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(result)


def calculator_agent(task: str, client: OpenAI, model: str = "roll-policy") -> str:
    """Solve `task` with the model behind `client`, calling `calc` when it asks; return its final answer."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[CALC], max_tokens=MAX_TOKENS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(str(expression))})
    return ""


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", help="a problem such as 37*48=?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="roll-policy")
    parser.add_argument("--api-key", default="EMPTY")
    cli = parser.parse_args()
    print(calculator_agent(cli.task, OpenAI(base_url=cli.base_url, api_key=cli.api_key), cli.model))
