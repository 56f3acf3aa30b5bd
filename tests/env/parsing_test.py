"""Action parsers: exact formats, lenient fallback, and totality on garbage."""

import pytest

from earl_jax.env import parsing
from earl_jax.env.parsing import ParseMode

GARBAGE = [
  "",
  None,
  b"\xff\xfe\x00<move>",
  bytearray(b"\x80\x81"),
  "x" * 1_000_000,
  "<move>" * 200_000,
  "</move>" * 200_000,
  "<move>9" + "9" * 5000 + "</move>",
  "\ud800\udfff",
  "<MOVE>3</MOVE>",
  "<move>-1</move>",
  "<move>3.0</move>",
  "<move>٣</move>",
  "<move>３</move>",
  "<move>²</move>",
  12345,
  object(),
]


@pytest.mark.parametrize(
  "text, expected",
  [
    ("<move>3</move>", 3),
    ("thinking... <move> 5 </move> done", 5),
    ("<move><move>2</move>", 2),
    ("<move>1</move><move>2</move>", 1),
    ("<move>three</move>", None),
    ("3", None),
    ("<move>3", None),
  ],
)
def test_tag_mode(text, expected):
  assert parsing.parse_action_int(text, "move", ParseMode.TAG) == expected


@pytest.mark.parametrize(
  "text, expected",
  [
    ("I play column 4, then 5", 4),
    ("<move>6</move> but maybe 2", 6),
    ("<move>x</move> 2", None),  # a present tag wins, even when its content is bad
    ("٣ or 7", 7),  # unicode digits are not numbers
    ("no digits", None),
  ],
)
def test_lenient_mode(text, expected):
  assert parsing.parse_action_int(text, "move", ParseMode.LENIENT) == expected


@pytest.mark.parametrize("mode", list(ParseMode))
@pytest.mark.parametrize("value", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_never_raises(value, mode):
  result = parsing.parse_action_int(value, "move", mode)
  assert result is None or (isinstance(result, int) and 0 <= result < 10**parsing.MAX_INT_DIGITS)


def test_to_text():
  assert parsing.to_text(None) == ""
  assert parsing.to_text(b"a\xffb") == "a\ufffdb"
  assert parsing.to_text(7) == "7"

  class Hostile:
    def __str__(self):
      raise ValueError("no")

  assert parsing.to_text(Hostile()) == ""


def test_first_tag_prefers_the_first_close():
  text = "<answer>4</answer><calc>1+1</calc>"
  assert parsing.first_tag(text, ("calc", "answer")) == ("answer", "4")
  assert parsing.first_tag("<calc>2*3</calc><answer>6", ("calc", "answer")) == ("calc", "2*3")
  assert parsing.first_tag("nothing", ("calc", "answer")) is None


@pytest.mark.parametrize(
  "content, expected",
  [("42", (42, 1)), ("-3.25", (-325, 100)), ("+7/2", (7, 2)), (" 0 ", (0, 1))],
)
def test_parse_number(content, expected):
  assert parsing.parse_number(content) == expected


@pytest.mark.parametrize("content", ["", "1/0", "1e5", "٣", "2+2", "1" * 40, "--1", "."])
def test_parse_number_rejects(content):
  assert parsing.parse_number(content) is None
