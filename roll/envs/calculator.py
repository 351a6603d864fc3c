"""Safe integer arithmetic for the calculator tool: the expression is parsed with `ast` and walked, never eval'd.

Integers, parentheses, unary `+ -` and `+ - * / // % **`. `/` is exact (a fraction, shown as a
decimal when it is not whole). Every number, given or computed, is held to `max_digits` digits, and
a power whose result would exceed that is refused before it is computed.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from fractions import Fraction

Number = int | Fraction

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: Fraction(a) / b,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    # A negative power of an int is a float in Python: keep it exact.
    ast.Pow: lambda a, b: Fraction(a) ** int(b) if b < 0 else a ** int(b),
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not allowed, too large, or cannot be computed (division by zero)."""


def calculate(expression: str, max_digits: int = 100, max_length: int = 200) -> str:
    """The value of the arithmetic `expression` as text; CalculatorError saying why when there is none."""
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an expression: {exc.msg}") from exc
    value = _Evaluator(max_bits=math.ceil(max_digits * math.log2(10))).eval(tree.body)
    if isinstance(value, Fraction) and value.denominator != 1:
        return f"{float(value):.10g}"
    return str(int(value))


class _Evaluator:
    def __init__(self, max_bits: int) -> None:
        self.max_bits = max_bits

    def eval(self, node: ast.expr) -> Number:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                return self._bounded(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
        if isinstance(node, ast.Constant):
            raise CalculatorError(f"only integers are allowed, not {node.value!r}")
        raise CalculatorError(f"{type(node).__name__} is not allowed: only integers, + - * / // % ** and ()")

    def _check_power(self, base: Number, exponent: Number) -> None:
        if isinstance(exponent, Fraction) and exponent.denominator != 1:
            raise CalculatorError("exponents must be integers")
        # |base| >= 2**(bits-1), so the result has at least (bits-1)*|exponent| bits.
        if (_bits(base) - 1) * abs(int(exponent)) > self.max_bits:
            raise CalculatorError("number too large")

    def _bounded(self, value: Number) -> Number:
        if _bits(value) > self.max_bits:
            raise CalculatorError("number too large")
        return value


def _bits(value: Number) -> int:
    fraction = Fraction(value)
    return max(abs(fraction.numerator).bit_length(), fraction.denominator.bit_length())
