"""Scripted players for the two-player game envs: opponents, and baseline policies to compare with.

An opponent is a function from an OpenSpiel state (opponent to move) to a legal action. Each is
built per episode from an RNG derived from the episode seed, so ``GameEnv.reset(seed)`` replays
the same opponent moves. The same players, on the policy's side of the board, are the baselines
every learning curve is read against (``baselines``): a policy that learned nothing but one
column, a one-ply tactician, a tree search.

Opponents are named by a spec string (``train.eval_opponents``): a kind (``random``,
``first_legal``, ``heuristic``, ``mcts``), and for ``mcts`` optionally its simulations per move
(``mcts:25``), so one run can evaluate against a weak and a strong search.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts

from earl_jax.types import ConfigError

Opponent = Callable[[pyspiel.State], int]


class OpponentKind(enum.Enum):
  RANDOM = "random"  # uniform over legal actions
  FIRST_LEGAL = "first_legal"  # the lowest legal action id (deterministic; handy in tests)
  HEURISTIC = "heuristic"  # one ply: win if it can, else block the opponent's win, else random
  MCTS = "mcts"  # OpenSpiel's MCTSBot with random-rollout evaluation


def make_opponent(
  kind: OpponentKind,
  game: pyspiel.Game,
  rng: np.random.RandomState,
  *,
  mcts_simulations: int,
  mcts_rollouts: int,
  mcts_uct_c: float,
) -> Opponent:
  """Builds one episode's opponent; all its randomness comes from ``rng``."""
  if kind is OpponentKind.RANDOM:
    return lambda state: int(rng.choice(state.legal_actions()))
  if kind is OpponentKind.FIRST_LEGAL:
    return lambda state: int(min(state.legal_actions()))
  if kind is OpponentKind.HEURISTIC:
    return lambda state: one_ply(state, rng)
  if kind is OpponentKind.MCTS:
    # The bot and its evaluator share the episode RNG: search and rollouts are both reproducible.
    evaluator = mcts.RandomRolloutEvaluator(n_rollouts=mcts_rollouts, random_state=rng)
    bot = mcts.MCTSBot(
      game,
      uct_c=mcts_uct_c,
      max_simulations=mcts_simulations,
      evaluator=evaluator,
      solve=True,
      random_state=rng,
    )
    return lambda state: int(bot.step(state))
  raise ValueError(f"unknown opponent kind {kind!r}; allowed: {[k.value for k in OpponentKind]}")


def _wins_after(state: pyspiel.State, action: int, player: int) -> bool:
  child = state.child(action)
  return child.is_terminal() and child.returns()[player] > 0


def winning_moves(state: pyspiel.State) -> list[int]:
  """The legal moves that win the game at once for the player to move."""
  me = state.current_player()
  return [a for a in state.legal_actions() if _wins_after(state, a, me)]


def blocking_moves(state: pyspiel.State) -> list[int]:
  """The legal moves that take a cell where the opponent would win next (its immediate threats,
  found by letting it move here instead of us: a pass)."""
  me = state.current_player()
  return [a for a in state.legal_actions() if _opponent_wins_at(state, a, me)]


def safe_moves(state: pyspiel.State) -> list[int]:
  """The legal moves after which the opponent cannot win at once. In a position with no win on
  offer and no threat to block, these are the moves that do not open a winning cell for the
  opponent (in Connect Four: the cell right above the piece played)."""
  safe = []
  for a in state.legal_actions():
    child = state.child(a)  # the opponent to move, unless the game is over
    if child.is_terminal() or not winning_moves(child):
      safe.append(a)
  return safe


def one_ply(state: pyspiel.State, rng: np.random.RandomState) -> int:
  """ "Win if you can, block if you must": a move that wins now; else one that takes the cell
  where the opponent would win next; else a uniformly random legal move."""
  wins = winning_moves(state)
  if wins:
    return int(wins[0])
  blocks = blocking_moves(state)
  if blocks:
    return int(blocks[0])
  return int(rng.choice(state.legal_actions()))


def _opponent_wins_at(state: pyspiel.State, action: int, me: int) -> bool:
  """Whether the opponent would win by taking ``action`` if it were its turn here. Asked by
  letting us play some other legal move first: in a drop or placement game our piece elsewhere
  cannot make or spoil the opponent's line through ``action``."""
  others = [a for a in state.legal_actions() if a != action]
  if not others:
    return False  # the only move left: it is played anyway
  child = state.child(others[0])
  return (
    not child.is_terminal()
    and action in child.legal_actions()
    and _wins_after(child, action, 1 - me)
  )


SPEC_HELP = "random | first_legal | heuristic | mcts | mcts:N (N simulations per move)"


def parse_spec(spec: str, key: str = "train.eval_opponents") -> tuple[str, dict[str, Any]]:
  """An opponent spec -> (its metric name, ``GameEnvConfig`` overrides): ``"mcts:25"`` ->
  ``("mcts25", {"opponent": "mcts", "mcts_simulations": 25})``; plain kinds keep their name."""
  kinds = {k.value for k in OpponentKind}
  kind, _, sims = spec.partition(":") if isinstance(spec, str) else ("", "", "")
  if kind not in kinds or (sims and (kind != "mcts" or not sims.isdigit() or int(sims) < 1)):
    raise ConfigError(key, spec, SPEC_HELP)
  if not sims:
    return kind, {"opponent": kind}
  return f"mcts{int(sims)}", {"opponent": kind, "mcts_simulations": int(sims)}
