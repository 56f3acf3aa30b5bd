"""Parsers from free model text to env actions; every function here is total (never raises).

Used by the envs between ``step(action_text)`` and their rules. Formats:

- Tags are exact and lower case: ``<move>3</move>``, ``<calc>2*(3+4)</calc>``,
  ``<answer>-7</answer>``. The tag used is the one that *closes* first; its content runs from the
  last opening tag before that close (so ``<move><move>3</move>`` reads ``3``). Whitespace around
  the content is ignored.
- Numbers are ASCII only: ``[0-9]``. Unicode digits (``"٣"``, ``"３"``, ``"²"``) do not count,
  because ``str.isdigit`` accepts characters that ``int`` then rejects, and a policy should learn
  one spelling.
- ``ParseMode.TAG`` needs the tag. ``ParseMode.LENIENT`` reads the tag when there is one and
  otherwise takes the first run of ASCII digits anywhere in the text.

All scanning is ``str.find``-based and linear in the input, so a 1 MB answer costs milliseconds
(a regex such as ``<move>(.*?)</move>`` is quadratic on inputs made of many opening tags).
"""

from __future__ import annotations

import enum
import re

# Longest digit run read as a number: keeps ``int`` far from Python's 4300-digit conversion limit.
MAX_INT_DIGITS = 9
_INT_RE = re.compile(rf"[0-9]{{1,{MAX_INT_DIGITS}}}")
_DIGITS_RE = re.compile(r"[0-9]+")
# A plain decimal or a fraction: "-12", "3.25", "7/2", "+0.5". ASCII only.
_NUMBER_RE = re.compile(r"[+-]?[0-9]{1,30}(\.[0-9]{1,30})?(/[0-9]{1,30})?")


class ParseMode(enum.Enum):
  TAG = "tag"  # only <move>N</move> counts
  LENIENT = "lenient"  # the tag if present, else the first ASCII digit run in the text


def to_text(value: object) -> str:
  """Any value -> str: None -> "", bytes -> UTF-8 with replacement characters, else ``str``."""
  if value is None:
    return ""
  if isinstance(value, str):
    return value
  if isinstance(value, (bytes, bytearray, memoryview)):
    return bytes(value).decode("utf-8", errors="replace")
  try:
    return str(value)
  except Exception:  # a hostile __str__; the policy simply said nothing usable
    return ""


def find_tag(text: str, tag: str) -> tuple[int, str] | None:
  """The first complete ``<tag>...</tag>`` as (end offset, stripped content), or None."""
  close = f"</{tag}>"
  end = text.find(close)
  if end < 0:
    return None
  start = text.rfind(f"<{tag}>", 0, end)
  if start < 0:
    return None
  return end + len(close), text[start + len(tag) + 2 : end].strip()


def first_tag(text: str, tags: tuple[str, ...]) -> tuple[str, str] | None:
  """Among ``tags``, the one whose first complete occurrence closes first: (tag, content)."""
  best: tuple[int, str, str] | None = None
  for tag in tags:
    found = find_tag(text, tag)
    if found is not None and (best is None or found[0] < best[0]):
      best = (found[0], tag, found[1])
  return None if best is None else (best[1], best[2])


def parse_int(content: str) -> int | None:
  """An exact non-negative ASCII integer (at most ``MAX_INT_DIGITS`` digits), else None."""
  if _INT_RE.fullmatch(content) is None:
    return None
  return int(content)


def parse_action_int(value: object, tag: str, mode: ParseMode) -> int | None:
  """The integer a policy chose, per the module-level format rules; None when there is none."""
  text = to_text(value)
  found = find_tag(text, tag)
  if found is not None:
    return parse_int(found[1])
  if mode is ParseMode.LENIENT:
    match = _DIGITS_RE.search(text)
    if match is not None:
      return parse_int(match.group(0))
  return None


def parse_number(content: str) -> tuple[int, int] | None:
  """A decimal or fraction literal as an exact (numerator, denominator), else None.

  Exact rather than float so a 30-digit answer compares without rounding; the caller applies the
  numeric tolerance.
  """
  content = content.strip()
  if _NUMBER_RE.fullmatch(content) is None:
    return None
  sign = -1 if content.startswith("-") else 1
  body = content.lstrip("+-")
  body, _, den_text = body.partition("/")
  whole, _, frac = body.partition(".")
  num = int(whole + frac) * sign
  den = 10 ** len(frac) * (int(den_text) if den_text else 1)
  if den == 0:
    return None
  return num, den
