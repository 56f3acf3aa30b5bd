"""Opponents for the two-player game envs: the side of the board the policy does not play.

An opponent is a function from an OpenSpiel state (opponent to move) to a legal action. Each is
built per episode from an RNG derived from the episode seed, so ``GameEnv.reset(seed)`` replays
the same opponent moves.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts

Opponent = Callable[[pyspiel.State], int]


class OpponentKind(enum.Enum):
  RANDOM = "random"  # uniform over legal actions
  FIRST_LEGAL = "first_legal"  # the lowest legal action id (deterministic; handy in tests)
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
