"""The calculator tool behind the tool-use env: a safe, exact arithmetic evaluator on ``ast``.

Accepted: int and decimal literals, ``+ - * / // % **``, parentheses, unary ``+``/``-``. Anything
else (names, calls, attributes, subscripts, comparisons, strings, ...) is refused. Arithmetic is
exact (``fractions.Fraction``), so ``0.1+0.2`` is ``0.3`` and problems have exact answers. Bounds
keep every call cheap: input length, node count, exponent size and the size of every
intermediate value. ``evaluate`` never raises; it returns a value or a short error message.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Callable
from fractions import Fraction

Number = Fraction


@dataclasses.dataclass(frozen=True)
class Limits:
  max_chars: int = 200  # longer expressions are refused before parsing
  max_nodes: int = 100  # AST nodes (bounds the recursion of the evaluator too)
  max_exponent: int = 64  # |b| in a ** b; b must be an integer
  max_abs: Fraction = Fraction(10**15)  # every intermediate |value|
  max_denominator: int = 10**9  # every intermediate denominator


@dataclasses.dataclass(frozen=True)
class EvalResult:
  value: Fraction | None  # None on error
  error: str = ""  # a short message for the policy when value is None


class _Refused(Exception):
  """Internal: aborts evaluation with a message for the policy."""


def _power(base: Fraction, exponent: Fraction, limits: Limits) -> Fraction:
  if exponent.denominator != 1:
    raise _Refused("exponent must be an integer")
  if abs(exponent) > limits.max_exponent:
    raise _Refused(f"exponent larger than {limits.max_exponent}")
  if base == 0 and exponent < 0:
    raise _Refused("division by zero")
  # Bound the result's size before computing it: a 60-bit base to the 64th is already huge.
  magnitude = max(abs(base.numerator), base.denominator)
  if magnitude > 1 and math.log2(magnitude) * abs(exponent) > 2 * math.log2(limits.max_abs):
    raise _Refused("result too large")
  return base ** int(exponent)


def _divide(op: Callable[[Fraction, Fraction], Fraction]) -> Callable[..., Fraction]:
  def apply(a: Fraction, b: Fraction, limits: Limits) -> Fraction:
    del limits
    if b == 0:
      raise _Refused("division by zero")
    return Fraction(op(a, b))

  return apply


_BINARY: dict[type, Callable[[Fraction, Fraction, Limits], Fraction]] = {
  ast.Add: lambda a, b, _: a + b,
  ast.Sub: lambda a, b, _: a - b,
  ast.Mult: lambda a, b, _: a * b,
  ast.Div: _divide(operator.truediv),
  ast.FloorDiv: _divide(operator.floordiv),
  ast.Mod: _divide(operator.mod),
  ast.Pow: _power,
}


def _check(value: Fraction, limits: Limits) -> Fraction:
  if abs(value) > limits.max_abs:
    raise _Refused("result too large")
  if value.denominator > limits.max_denominator:
    raise _Refused("result too precise")
  return value


def _eval(node: ast.AST, limits: Limits) -> Fraction:
  if isinstance(node, ast.Expression):
    return _eval(node.body, limits)
  if isinstance(node, ast.Constant):
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
      raise _Refused(f"not a number: {type(node.value).__name__}")
    if isinstance(node.value, float) and not math.isfinite(node.value):
      raise _Refused("number too large")
    # repr() gives the shortest decimal that round-trips, so 2.5 -> 5/2 and 0.1 -> 1/10 exactly.
    return _check(Fraction(repr(node.value)), limits)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
    value = _eval(node.operand, limits)
    return -value if isinstance(node.op, ast.USub) else value
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left, limits), _eval(node.right, limits)
    return _check(_BINARY[type(node.op)](left, right, limits), limits)
  raise _Refused(f"not arithmetic: {type(node).__name__}")


def evaluate(expression: object, limits: Limits = Limits()) -> EvalResult:
  """Evaluates an arithmetic expression; never raises (errors come back as ``EvalResult.error``)."""
  if not isinstance(expression, str):
    return EvalResult(None, "expression must be text")
  if len(expression) > limits.max_chars:
    return EvalResult(None, f"expression longer than {limits.max_chars} characters")
  if not expression.strip():
    return EvalResult(None, "empty expression")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    return EvalResult(None, "syntax error")
  if sum(1 for _ in ast.walk(tree)) > limits.max_nodes:
    return EvalResult(None, f"expression has more than {limits.max_nodes} parts")
  try:
    return EvalResult(_eval(tree, limits))
  except _Refused as e:
    return EvalResult(None, str(e))
  except (ArithmeticError, ValueError, MemoryError, RecursionError):
    return EvalResult(None, "cannot compute")


def format_number(value: Fraction) -> str:
  """Exact integers as integers; other values as decimals with up to 6 places."""
  if value.denominator == 1:
    return str(value.numerator)
  text = f"{float(value):.6f}".rstrip("0").rstrip(".")
  return "0" if text in ("-0", "") else text
