"""Tool calls in both formats, the calculator, the tool-calling wrapper and the python tool in the code sandbox."""

from __future__ import annotations

import time

import pytest

from roll.envs.builtin.guess_number import GuessNumberEnv
from roll.envs.calculator import CalculatorError, calculate
from roll.envs.tool_calls import ToolCall, parse_tool_calls
from roll.envs.tools import CALCULATOR, Tool, ToolEnv, python_tool, resolve_tool
from roll.rewards.code_sandbox import Limits


def _stuck(argument: str) -> str:
    time.sleep(1.0)  # past the test's 0.3 s timeout; the abandoned thread then ends by itself
    return "too late"


STUCK = Tool("stuck", "x", _stuck)
SHOUT = Tool("shout", "text", str.upper, "Upper-case the text.")

# parsing


def test_hermes_calls_parse() -> None:
    text = 'let me compute <tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calc", {"expression": "12*34"})]
    as_string = '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert parse_tool_calls(as_string) == [ToolCall("calc", {"expression": "1+1"})]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{'name': 'calc'}</tool_call>", "invalid JSON"),
        ('<tool_call>{"name": "calc", "arguments": {"expression": "1"}', "no </tool_call>"),
        ('<tool_call>["calc"]</tool_call>', 'expected {"name"'),
        ('<tool_call>{"arguments": {}}</tool_call>', 'expected {"name"'),
    ],
)
def test_malformed_hermes_calls_are_calls_with_an_error(text: str, error: str) -> None:
    [call] = parse_tool_calls(text)
    assert call.error is not None and error in call.error


def test_bracket_calls_parse() -> None:
    assert parse_tool_calls("[calc 12*34]") == [ToolCall("calc", "12*34")]
    assert parse_tool_calls("so [calc (1+2)*3] then [python print(1)]") == [
        ToolCall("calc", "(1+2)*3"),
        ToolCall("python", "print(1)"),
    ]
    assert parse_tool_calls("[calc 12*34")[0].error == "malformed tool call: no closing ']'"
    assert parse_tool_calls("{calc 2*3}", brackets=("{", "}")) == [ToolCall("calc", "2*3")]


def test_text_without_calls_and_format_selection() -> None:
    assert parse_tool_calls("408") == []
    assert parse_tool_calls("[1, 2] and [Calc 1] are no calls") == []
    assert parse_tool_calls("[calc 1+1]", formats=["hermes"]) == []
    mixed = '[calc 1] <tool_call>{"name": "calc", "arguments": {"expression": "2"}}</tool_call> [calc 3]'
    assert [call.arguments for call in parse_tool_calls(mixed)] == ["1", {"expression": "2"}, "3"]
    with pytest.raises(ValueError, match="unknown tool-call formats"):
        parse_tool_calls("", formats=["xml"])


# the calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12*34", "408"),
        ("(3+4)*5-1", "34"),
        ("7/2", "3.5"),
        ("6/3", "2"),
        ("10//3", "3"),
        ("-10%3", "2"),
        ("2**10", "1024"),
        ("2**-2", "0.25"),
        ("1**(10**50)", "1"),
        (" 999 * 999 ", "998001"),
    ],
)
def test_calculator_results(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("2**1000", "number too large"),
        ("9**9**9", "number too large"),
        ("10**100*10", "number too large"),
        ("1/0", "division by zero"),
        ("5%0", "division by zero"),
        ("0**-1", "division by zero"),
        ("1.5*2", "only integers"),
        ("2**(1/2)", "exponents must be integers"),
        ("__import__('os')", "Call is not allowed"),
        ("x+1", "Name is not allowed"),
        ("1 +", "not an expression"),
        ("1+" * 200 + "1", "longer than 200"),
    ],
)
def test_calculator_refusals(expression: str, error: str) -> None:
    with pytest.raises(CalculatorError, match=error):
        calculate(expression)


# the wrapper


def test_a_tool_call_is_answered_by_the_tool_and_never_reaches_the_inner_env() -> None:
    env = ToolEnv(GuessNumberEnv(n=10), tools=["calc", SHOUT])
    env.reset(seed=1)  # secret 3
    assert env.step("[calc 2+1]") == (
        "3",
        0.0,
        False,
        False,
        {"tool_calls": 1, "tool_successes": 1, "observation_role": "tool"},
    )
    assert env.env.turns == 0
    assert env.step('<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>')[0] == "HI"
    assert env.step("3") == (
        "correct",
        1.0,
        True,
        False,
        {"invalid_action": 0, "success": 1.0, "tool_calls": 0, "tool_successes": 0},
    )
    assert env.env.turns == 1


@pytest.mark.parametrize(
    ("action", "answer"),
    [
        ("[calc 1/0]", "error: division by zero"),
        ("[calc 2**99999]", "error: number too large"),
        ("[sum 1 2]", "error: unknown tool 'sum' (tools: calc)"),
        ("<tool_call>{bad json}</tool_call>", "error: malformed tool call: invalid JSON"),
        (
            '<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>',
            'error: calc takes {"expression": ...}',
        ),
    ],
)
def test_failed_calls_answer_with_the_error(action: str, answer: str) -> None:
    env = ToolEnv(GuessNumberEnv(), tools=["calc"])
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(action)
    assert observation.startswith(answer)
    assert (reward, terminated, truncated, info["tool_calls"], info["tool_successes"]) == (0.0, False, False, 1, 0)


def test_several_calls_in_one_action_and_the_per_turn_limit() -> None:
    env = ToolEnv(GuessNumberEnv(), tools=["calc"], max_calls_per_turn=2)
    env.reset(seed=0)
    observation, _, _, _, info = env.step("[calc 1+1] [calc 1/0] [calc 3*3]")
    assert observation == "2\nerror: division by zero\nerror: at most 2 tool calls per turn"
    assert (info["tool_calls"], info["tool_successes"]) == (3, 1)


def test_a_tool_that_hangs_is_answered_with_a_timeout() -> None:
    env = ToolEnv(GuessNumberEnv(), tools=[STUCK, "calc"], timeout_s=0.3)
    env.reset(seed=0)
    observation, _, _, _, info = env.step("[stuck 1] [calc 2*2]")
    assert observation == "error: timed out after 0.3s\n4"
    assert (info["tool_calls"], info["tool_successes"]) == (2, 1)


def test_tools_resolve_and_render_their_schema() -> None:
    assert resolve_tool("calc") is CALCULATOR
    assert resolve_tool("tests.unit.test_envs_tools.SHOUT") is SHOUT
    with pytest.raises(ValueError, match=r"tools 'abacus' is not a built-in tool \(calc, python\)"):
        resolve_tool("abacus")
    with pytest.raises(ValueError, match=r"is a function, not a roll\.envs\.tools\.Tool"):
        resolve_tool("tests.unit.test_envs_tools._stuck")
    with pytest.raises(ValueError, match="distinct"):
        ToolEnv(GuessNumberEnv(), tools=["calc", "calc"])
    assert ToolEnv(GuessNumberEnv(), tools=["calc"]).tool_schemas() == [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": CALCULATOR.description,
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            },
        }
    ]


# the python tool, in the code sandbox


def test_python_tool_runs_in_the_sandbox() -> None:
    env = ToolEnv(GuessNumberEnv(), tools=[python_tool(Limits(time_s=0.5, memory_mb=256))], timeout_s=20)
    env.reset(seed=0)
    code = '<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>'
    assert env.step(code)[0] == "45"
    assert env.step("[python 1/0]")[0] == "error: ZeroDivisionError: division by zero"
    assert env.step("[python while True: pass]")[0] == "error: timed out after 0.5s"
