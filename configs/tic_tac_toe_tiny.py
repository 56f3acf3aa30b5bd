"""Tic-Tac-Toe with a tiny from-scratch character-level policy (the paper's motivating game), CPU.

Launch: python launch/train.py --config=configs/tic_tac_toe_tiny.py
"""

import ml_collections

from configs import connect_four_tiny


def get_config() -> ml_collections.ConfigDict:
  c = connect_four_tiny.get_config()
  c.env.name = "tic_tac_toe"
  c.env.game.observation = "compact"  # the 3x3 board, empty cells numbered (no columns here)
  c.rollout.max_turns = 8  # at most 5 moves per side, plus retries
  c.rollout.max_context = 256
  c.model.max_seq_len = 256
  c.train.baselines = ("heuristic", "mcts:10", "mcts:50")  # one fixed cell forfeits at once
  return connect_four_tiny.plain_grpo(c)
