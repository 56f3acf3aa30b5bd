"""Tool-use env: arithmetic and short word problems, solved over several turns with a calculator.

Sits between the rollout loop (text in, text out) and the safe evaluator in ``arithmetic``. Each
``reset(seed)`` draws one problem. Each policy turn may

- call the tool: ``<calc>3*(4+5)</calc>`` -> observation ``<result>27</result>`` (or
  ``<result>error: not arithmetic: Name</result>``; tool errors cost nothing),
- or finish: ``<answer>27</answer>`` (an integer, decimal or ``a/b``) -> done, outcome
  ``correct`` (reward ``correct_reward``) when within ``tolerance`` (relative, at least absolute
  ``tolerance``) of the exact answer, else ``wrong`` (``wrong_reward``).

Of several tags the one that closes first counts (the rollout loop should stop generation at
``</calc>``). Text with neither tag, or an answer that is not a number, is malformed: reward
``malformed_penalty`` and observation ``malformed``/a short hint, or the episode ends as
``invalid`` when ``on_malformed`` is ``end``. After ``max_turns`` policy turns without an
answer the episode ends as ``truncated``.

Observations: compact ``q: 3*(4+5)-2`` or ``q: Ann has 12 pens, ...``; verbose adds a line
with the answer format. Numbers are written as ``arithmetic.format_number`` does.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from fractions import Fraction
from typing import Any

import numpy as np

from earl_jax.env import arithmetic, base, parsing
from earl_jax.types import ConfigError

RESULT_RE = re.compile(r"<result>(-?[0-9]+(?:\.[0-9]+)?)</result>")
_NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay")
_ITEMS = ("apples", "pens", "coins", "cards", "eggs", "books")


class ProblemKind(enum.Enum):
  ARITHMETIC = "arithmetic"  # a random expression over + - * with parentheses
  WORD = "word"  # a short story whose answer takes two or three operations


@dataclasses.dataclass(frozen=True)
class Problem:
  question: str
  expression: str  # an expression whose value is the answer (what a perfect tool user computes)
  answer: Fraction


@dataclasses.dataclass(frozen=True)
class CalculatorEnvConfig:
  kinds: tuple[ProblemKind, ...] = (ProblemKind.ARITHMETIC, ProblemKind.WORD)
  min_ops: int = 2  # arithmetic problems: operators per expression, drawn in [min_ops, max_ops]
  max_ops: int = 3
  max_operand: int = 20  # operands are drawn from 1..max_operand
  max_turns: int = 4  # policy turns (tool calls included) before the episode is truncated
  tolerance: float = 1e-6
  correct_reward: float = 1.0
  wrong_reward: float = 0.0
  malformed_penalty: float = -0.1
  on_malformed: base.OnInvalid = base.OnInvalid.RETRY
  observation: base.ObservationMode = base.ObservationMode.COMPACT

  def __post_init__(self):
    if not self.kinds or not all(isinstance(k, ProblemKind) for k in self.kinds):
      raise ConfigError(
        "kinds", self.kinds, f"a non-empty tuple of {[k.value for k in ProblemKind]}"
      )
    if not 1 <= self.min_ops <= self.max_ops <= 6:
      raise ConfigError(
        "max_ops", self.max_ops, f"an int with 1 <= min_ops ({self.min_ops}) <= max_ops <= 6"
      )
    # Every generated value must stay inside the calculator's bounds (|v| <= 1e15).
    if self.max_operand < 2 or self.max_operand ** (self.max_ops + 1) > 10**15:
      allowed = f"an int >= 2 with max_operand ** (max_ops + 1) <= 1e15 (max_ops={self.max_ops})"
      raise ConfigError("max_operand", self.max_operand, allowed)
    if self.max_turns < 1:
      raise ConfigError("max_turns", self.max_turns, "a positive int")
    if not (math.isfinite(self.tolerance) and 0 <= self.tolerance < 1):
      raise ConfigError("tolerance", self.tolerance, "a float in [0, 1)")
    for key in ("correct_reward", "wrong_reward", "malformed_penalty"):
      if not math.isfinite(getattr(self, key)):
        raise ConfigError(key, getattr(self, key), "a finite float")
    if not isinstance(self.on_malformed, base.OnInvalid):
      raise ConfigError(
        "on_malformed", self.on_malformed, f"one of {[m.value for m in base.OnInvalid]}"
      )
    boards = (base.ObservationMode.MOVES, base.ObservationMode.COLUMNS, base.ObservationMode.LINES)
    if self.observation in boards:
      raise ConfigError("observation", self.observation.value, "'compact' or 'verbose' (no board)")
    if not isinstance(self.observation, base.ObservationMode):
      modes = [m.value for m in base.ObservationMode]
      raise ConfigError("observation", self.observation, f"one of {modes}")


def _expression(rng: np.random.RandomState, num_ops: int, max_operand: int) -> str:
  """A random binary expression tree over + - * with ``num_ops`` operators, inner nodes in
  parentheses, e.g. ``((3+4)*(5-2))``."""
  if num_ops == 0:
    return str(rng.randint(1, max_operand + 1))
  left_ops = int(rng.randint(num_ops))
  left = _expression(rng, left_ops, max_operand)
  right = _expression(rng, num_ops - 1 - left_ops, max_operand)
  return f"({left}{'+-*'[rng.randint(3)]}{right})"


def _word_problem(rng: np.random.RandomState, cfg: CalculatorEnvConfig) -> tuple[str, str]:
  name, item = _NAMES[rng.randint(len(_NAMES))], _ITEMS[rng.randint(len(_ITEMS))]
  n = cfg.max_operand
  a, b, c = (int(rng.randint(2, n + 1)) for _ in range(3))
  template = rng.randint(3)
  if template == 0:
    d = int(rng.randint(1, a + 1))
    text = f"{name} has {a} {item}, buys {b} packs of {c} and gives away {d}. How many now?"
    return text, f"{a}+{b}*{c}-{d}"
  if template == 1:
    d = int(rng.randint(1, c))
    text = (
      f"{b} kids share {b * c} {item} equally and each gives {d} away. How many does each keep?"
    )
    return text, f"{b * c}/{b}-{d}"
  text = f"A box holds {a} {item}. {name} fills {b} boxes and has {c} left over. How many in all?"
  return text, f"{a}*{b}+{c}"


def make_problem(seed: int, cfg: CalculatorEnvConfig) -> Problem:
  """The problem of episode ``seed``; answers come from the same evaluator the tool uses."""
  rng = base.derive_rng(seed, "problem")
  kind = cfg.kinds[rng.randint(len(cfg.kinds))]
  if kind is ProblemKind.ARITHMETIC:
    num_ops = int(rng.randint(cfg.min_ops, cfg.max_ops + 1))
    expression = _expression(rng, num_ops, cfg.max_operand)[1:-1]  # drop the outer parentheses
    question = expression
  else:
    question, expression = _word_problem(rng, cfg)
  result = arithmetic.evaluate(expression)
  if result.value is None:  # a generator bug (the config bounds the sizes), never model input
    raise RuntimeError(f"generated problem {expression!r} does not evaluate: {result.error}")
  return Problem(question, expression, result.value)


class CalculatorEnv:
  """One problem per episode; see the module docstring for the formats."""

  def __init__(self, config: CalculatorEnvConfig | None = None):
    self.config = config or CalculatorEnvConfig()
    self._guard = base.EpisodeGuard("CalculatorEnv")
    self._problem: Problem | None = None

  @property
  def instructions(self) -> str:
    if self.config.observation is base.ObservationMode.COMPACT:
      return "Solve q. <calc>expr</calc> gives <result>v</result>. End with <answer>v</answer>."
    return (
      "Solve the problem. You may use a calculator: write <calc>expression</calc> (numbers, "
      "+ - * / // % ** and parentheses) and you get <result>value</result> back. When you know "
      f"the answer, write <answer>number</answer>. You have {self.config.max_turns} turns."
    )

  @property
  def problem(self) -> Problem:
    if self._problem is None:
      raise RuntimeError("CalculatorEnv.problem read before reset(seed)")
    return self._problem

  def reset(self, seed: int) -> str:
    self._problem = make_problem(base.check_seed(seed), self.config)
    self._turn = 0
    self._calls = 0
    self._guard.start()
    if self.config.observation is base.ObservationMode.COMPACT:
      return f"q: {self._problem.question}"
    return f"Problem: {self._problem.question}\nAnswer with <answer>number</answer>."

  def step(self, action_text: object) -> base.StepResult:
    self._guard.check_running()
    self._turn += 1
    found = parsing.first_tag(parsing.to_text(action_text), ("calc", "answer"))
    if found is not None and found[0] == "answer":
      number = parsing.parse_number(found[1])
      if number is not None:
        return self._answer(Fraction(*number))
    if found is None or found[0] == "answer":
      return self._malformed()
    self._calls += 1
    result = arithmetic.evaluate(found[1])
    if result.value is None:
      obs = f"<result>error: {result.error}</result>"
    else:
      obs = f"<result>{arithmetic.format_number(result.value)}</result>"
    return self._continue(obs, 0.0, legal=True)

  def _answer(self, value: Fraction) -> base.StepResult:
    cfg, truth = self.config, self.problem.answer
    ok = abs(value - truth) <= Fraction(cfg.tolerance) * max(Fraction(1), abs(truth))
    outcome = base.Outcome.CORRECT if ok else base.Outcome.WRONG
    reward = cfg.correct_reward if ok else cfg.wrong_reward
    return self._end(outcome.value, float(reward), outcome, legal=True)

  def _malformed(self) -> base.StepResult:
    cfg = self.config
    if cfg.on_malformed is base.OnInvalid.END:
      return self._end("invalid", cfg.malformed_penalty, base.Outcome.INVALID, legal=False)
    if cfg.observation is base.ObservationMode.COMPACT:
      obs = "malformed"
    else:
      obs = "Malformed: use <calc>expression</calc> or <answer>number</answer>."
    return self._continue(obs, cfg.malformed_penalty, legal=False)

  def _continue(self, obs: str, reward: float, legal: bool) -> base.StepResult:
    if self._turn >= self.config.max_turns:
      return self._end(f"{obs}\ntruncated", reward, base.Outcome.TRUNCATED, legal)
    return base.StepResult(obs, float(reward), False, self._info(None, legal))

  def _end(self, obs: str, reward: float, outcome: base.Outcome, legal: bool) -> base.StepResult:
    self._guard.finish()
    return base.StepResult(obs, float(reward), True, self._info(outcome, legal))

  def _info(self, outcome: base.Outcome | None, legal: bool) -> dict[str, Any]:
    return {
      "outcome": None if outcome is None else outcome.value,
      "legal": legal,
      "turn": self._turn,
      "calls": self._calls,
      "answer": arithmetic.format_number(self.problem.answer),
    }
