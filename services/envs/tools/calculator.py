"""A calculator: arithmetic on numbers read with ``ast`` (never ``eval``), with bounded sizes."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, ClassVar

from services.envs.tools.base import Tool, ToolFailure

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log,
             "exp": math.exp, "floor": math.floor, "ceil": math.ceil}
CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_EXPONENT = 1000
MAX_DIGITS = 4000
MAX_LENGTH = 500


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; raises ToolFailure naming what is not allowed."""
    if len(expression) > MAX_LENGTH:
        raise ToolFailure(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolFailure(f"not an expression: {exc.msg}") from None
    try:
        return _value(tree.body)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as exc:
        raise ToolFailure(f"{type(exc).__name__}: {exc}") from None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolFailure(f"exponents above {MAX_EXPONENT} are not allowed")
        out = BINARY[type(node.op)](left, right)
        if isinstance(out, int) and out.bit_length() > MAX_DIGITS * 3.33:
            raise ToolFailure(f"results above {MAX_DIGITS} digits are not allowed")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords):
        return FUNCTIONS[node.func.id](*[_value(a) for a in node.args])
    raise ToolFailure(f"{ast.unparse(node)!r} is not allowed: numbers, + - * / // % ** ( ), "
                      f"{', '.join(FUNCTIONS)}, {', '.join(CONSTANTS)}")


class Calculator(Tool):
    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = "Evaluate an arithmetic expression, e.g. (17*23)+4 or sqrt(2)."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"expression": {"type": "string", "description": "the expression"}},
        "required": ["expression"]}

    async def call(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolFailure('calculator takes {"expression": "..."}')
        value = evaluate(expression)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return str(value)
