"""The environment protocol: what the multi-turn rollout loop talks to (host side, never jitted).

An episode is text in, text out: ``reset(seed)`` returns the first observation, then the policy's
text goes to ``step(action_text)`` until ``StepResult.done``. The rollout loop prepends the env's
``instructions`` (rules and the exact answer format) once, as the system prompt. Rewards are per
step; an episode's return is their sum. ``reset(seed)`` fully determines the episode (opponent and
problem randomness included), so runs are reproducible and resumable from a seed list.

``step`` never raises on model output, whatever it is (empty, 1 MB, bytes, None, wrong tags); it
raises only on caller bugs (stepping before ``reset`` or after ``done``).

An env whose every acceptable answer comes from a small fixed set (a game's moves) may expose it
as ``answer_alphabet`` (a tuple of strings; None or absent otherwise): a run with
``sampler.restrict_answers`` then decodes one token of that set per turn. If it also knows which
of them are legal now, it exposes ``legal_answer_bits()`` (an int, bit j set: answer j is legal),
and ``sampler.legal_answers`` decodes only those (action masking). An env with a scripted expert
may also expose ``expert_answer_bits()`` (the same kind of mask: the answers the expert would give
now, 0 for no opinion), the labels of the imitation term (``rl.loss.imitation_coef``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np


class Outcome(enum.Enum):
  """How an episode ended (``info["outcome"]``); ``None`` in info while it is still running."""

  WIN = "win"
  LOSS = "loss"
  DRAW = "draw"
  CORRECT = "correct"  # tool-use envs: the final answer matched
  WRONG = "wrong"  # tool-use envs: a well-formed final answer that did not match
  INVALID = "invalid"  # ended by an unparseable or illegal action
  TRUNCATED = "truncated"  # ran out of turns


class ObservationMode(enum.Enum):
  COMPACT = "compact"  # minimal text for tiny character-level policies (short contexts)
  VERBOSE = "verbose"  # full sentences and the answer format, for chat models
  MOVES = "moves"  # games only: the opponent's last move, no board (the history implies it);
  # the shortest context
  COLUMNS = "columns"  # games with columns (Connect Four): the opponent's last move and the board
  # column by column, bottom up, the policy's pieces '+' and the opponent's '-': the whole
  # position in a few characters, seen from the policy's side
  LINES = "lines"  # games with columns (Connect Four): the opponent's last move, then per column
  # the longest line a piece dropped there would complete for the policy (a-d) and for the
  # opponent (A-D), and the column's number: the local threats, not the board


class OnInvalid(enum.Enum):
  """What an env does after an invalid action (each one costs the configured penalty)."""

  END = "end"  # the episode ends with Outcome.INVALID
  RETRY = "retry"  # a short error observation asks again, up to max_retries times in a row


@dataclasses.dataclass(frozen=True)
class StepResult:
  """One env transition.

  Attributes:
    observation: text for the policy's next turn (the final position or a verdict when done).
    reward: reward of this step alone.
    done: the episode is over; further ``step`` calls raise.
    info: always holds ``outcome`` (an ``Outcome`` value string, or None while running),
      ``legal`` (the action was understood and allowed) and ``turn`` (policy turns so far,
      this one included); envs add their own keys.
  """

  observation: str
  reward: float
  done: bool
  info: Mapping[str, Any]


@runtime_checkable
class Env(Protocol):
  """A text environment. Implementations: ``GameEnv``, ``CalculatorEnv``."""

  @property
  def instructions(self) -> str:
    """The rules and the exact answer format, meant as the system prompt."""
    ...

  def reset(self, seed: int) -> str:
    """Starts the episode that ``seed`` determines and returns its first observation."""
    ...

  def step(self, action_text: object) -> StepResult:
    """Applies the policy's text; never raises on any ``action_text``."""
    ...


def check_seed(seed: object) -> int:
  """Validates an episode seed (a non-negative int; numpy ints are fine)."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"episode seed must be a non-negative int, got {seed!r}")
  return int(seed)


def derive_rng(seed: int, stream: str) -> np.random.RandomState:
  """An independent RandomState per (episode seed, purpose), so adding a random draw for one
  purpose (e.g. the opponent) never shifts the draws of another (e.g. the side assignment)."""
  words = [int(seed) & 0xFFFFFFFF, int(seed) >> 32] + [ord(c) for c in stream]
  state = np.random.SeedSequence(words).generate_state(1)[0]
  return np.random.RandomState(int(state))


class EpisodeGuard:
  """Tracks reset/done so every env raises the same clear error on misuse."""

  def __init__(self, name: str):
    self._name = name
    self._running = False

  def start(self) -> None:
    self._running = True

  def finish(self) -> None:
    self._running = False

  def check_running(self) -> None:
    if not self._running:
      raise RuntimeError(
        f"{self._name}.step called with no running episode: call reset(seed) first "
        "(after a StepResult with done=True the episode is over)"
      )
