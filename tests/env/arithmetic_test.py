"""The calculator tool: exact arithmetic, and a refusal for everything that is not arithmetic."""

from fractions import Fraction

import pytest

from earl_jax.env import arithmetic


@pytest.mark.parametrize(
  "expr, expected",
  [
    ("1+2*3", Fraction(7)),
    ("(1+2)*3", Fraction(9)),
    ("0.1+0.2", Fraction(3, 10)),
    ("7/2", Fraction(7, 2)),
    ("7//2", Fraction(3)),
    ("-7%3", Fraction(2)),
    ("-3**2", Fraction(-9)),
    ("2**-2", Fraction(1, 4)),
    ("+-+4", Fraction(-4)),
    (" 2 ** 10 ", Fraction(1024)),
    ("1_000 + 1", Fraction(1001)),
    ("(" * 90 + "1" + ")" * 90, Fraction(1)),
  ],
)
def test_evaluates(expr, expected):
  result = arithmetic.evaluate(expr)
  assert result.error == ""
  assert result.value == expected


@pytest.mark.parametrize(
  "expr, error",
  [
    ("x", "not arithmetic: Name"),
    ("abs(-1)", "not arithmetic: Call"),
    ("__import__('os').system('true')", "not arithmetic: Call"),
    ("(1).real", "not arithmetic: Attribute"),
    ("[1][0]", "not arithmetic: Subscript"),
    ("1 < 2", "not arithmetic: Compare"),
    ("1 if 1 else 2", "not arithmetic: IfExp"),
    ("lambda: 1", "not arithmetic: Lambda"),
    ("~1", "not arithmetic: UnaryOp"),
    ("1 << 4", "not arithmetic: BinOp"),
    ("'a' * 3", "not a number: str"),
    ("True + 1", "not a number: bool"),
    ("1j", "not a number: complex"),
    ("1e400", "number too large"),
    ("1e300", "result too large"),
    ("2**100", "exponent larger than 64"),
    ("9**9**9", "exponent larger than 64"),
    ("1000**60", "result too large"),
    ("2**60*2**60", "result too large"),
    ("2**0.5", "exponent must be an integer"),
    ("2**65", "exponent larger than 64"),
    ("10**15*10", "result too large"),
    ("1/3**30", "result too precise"),
    ("1/0", "division by zero"),
    ("5//0", "division by zero"),
    ("5%0", "division by zero"),
    ("0**-1", "division by zero"),
    ("", "empty expression"),
    ("1+", "syntax error"),
    ("import os", "syntax error"),
    ("1\x00", "syntax error"),
    ("1" * 201, "expression longer than 200 characters"),
    ("+".join(["1"] * 60), "expression has more than 100 parts"),
  ],
)
def test_refuses(expr, error):
  result = arithmetic.evaluate(expr)
  assert result.value is None
  assert result.error == error


@pytest.mark.parametrize("value", [None, b"1+1", 3, ["1"]])
def test_non_text_is_refused(value):
  assert arithmetic.evaluate(value).error == "expression must be text"


def test_limits_are_configurable():
  limits = arithmetic.Limits(max_exponent=200, max_abs=Fraction(2**150))
  assert arithmetic.evaluate("2**100", limits).value == 2**100


@pytest.mark.parametrize(
  "value, text",
  [
    (Fraction(3), "3"),
    (Fraction(-7, 2), "-3.5"),
    (Fraction(1, 3), "0.333333"),
    (Fraction(-1, 10**8), "0"),
  ],
)
def test_format_number(value, text):
  assert arithmetic.format_number(value) == text
