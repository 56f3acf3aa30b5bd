"""Connect Four with a tiny from-scratch character-level policy: the default run, on CPU.

Each turn the policy sees the opponent's last move and, for each column, the longest line a piece
dropped there would make for itself (a-d) and for the opponent (A-D), closed by the column's number
("lines" observation). It answers one column digit: its answer is decoded from the seven column
tokens only (sampler.restrict_answers), narrowed to the columns that are not full
(sampler.legal_answers, action masking), and the loss scores that same masked distribution. Each
episode group plays the random opponent or the one-ply heuristic (env.game.opponent_mix). Next to
the GRPO loss, an imitation term pulls the policy towards the one-ply expert's answer on the turns
that have one (a win on offer, else a block), in the positions the policy itself reached
(rl.loss.imitation_coef); the other turns are learned from the rewards alone. It is evaluated
greedily against random, the heuristic and MCTS with 10 simulations, next to scripted baselines
played on the same episodes (printed at start-up, dashed in the plots): read the win rate against
``stack`` (the one-column policy under the same masks) and against the heuristic (which wins when it
can and blocks every open three).

Launch: python launch/train.py --config=configs/connect_four_tiny.py
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  c = base.get_config()
  c.model.vocab_size = 105  # exactly the built-in character tokenizer (CharTokenizer().vocab_size)
  c.model.embed_dim = 64
  c.model.mlp_dim = 128
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.max_seq_len = 1024
  # RoPE base 100 instead of 10000. Of a 16-wide head's 8 rotation frequencies, 5 turn less than
  # 0.05 rad per token at 10000 and 2 at 100: more of each head tells neighbouring tokens apart,
  # which is what reading a column's letters next to its number takes. Measured: the plateau
  # before the policy reads the board ends earlier (README, "What to expect").
  c.model.rope.theta = 100.0
  c.tokenizer.kind = "char"

  # Each turn: for each column, the longest line a piece there would make for the policy (a-d)
  # and for the opponent (A-D), then the column's number (env/games.py, "lines").
  c.env.game.observation = "lines"
  # One opponent per episode (so per GRPO group): random, or the one-ply heuristic that wins when
  # it can and blocks when it must. Against random alone a blocking position is rare: few blocks to
  # imitate, none rewarded (the imitation term alone reached 0.312 vs the heuristic in 500 steps).
  c.env.game.opponent_mix = ("random", "heuristic")
  c.env.game.parse_mode = "lenient"  # the answer is the column digit (restrict_answers needs it)
  # Rewards: a win 1, a draw or a loss 0. The masks leave no illegal answer to make; the invalid
  # penalties below apply only where the masks are turned off (sampler.legal_answers=False):
  # -0.05 per illegal answer asked again (up to 4 in a row), -1 for forfeiting by a fifth.
  c.env.game.on_invalid = "retry"
  c.env.game.max_retries = 4
  c.env.game.invalid_penalty = -0.05
  c.env.game.forfeit_reward = -1.0
  c.env.game.win_reward = 1.0
  c.env.game.draw_reward = 0.0
  c.env.game.loss_reward = 0.0

  c.sampler.temperature = 1.0
  c.sampler.restrict_answers = True  # one token of "0".."6" per turn
  c.sampler.legal_answers = True  # ... among the columns that are not full
  c.rollout.num_slots = 32
  c.rollout.max_turns = 24  # a Connect Four game has at most 21 moves per side
  c.rollout.max_new_tokens = 1  # the column digit (restrict_answers)
  c.rollout.max_context = 1024  # a 42-move game of columns observations is about 800 tokens
  c.rollout.chunk_multiple = 8
  c.rollout.seq_multiple = 64

  c.rl.num_groups = 8
  c.rl.group_size = 4
  c.rl.logp_chunk = 64
  # Imitation term: -log pi(the env's one-ply expert's answers) on the turns it labels (a win on
  # offer, else a block), taken in the positions the policy itself reached, next to the RL loss.
  c.rl.loss.imitation_coef = 3.0
  c.optim.learning_rate = 2e-3
  c.optim.warmup_steps = 5
  c.optim.decay_steps = 500
  c.optim.end_lr_ratio = 0.2

  c.train.num_steps = 500
  c.train.eval_every = 50
  c.train.eval_episodes = 64
  c.train.final_eval_episodes = 256  # the final figure: about +-0.015 at 0.95, not +-0.03
  c.train.eval_opponents = ("random", "heuristic", "mcts:10")
  c.train.baselines = ("column", "stack", "heuristic", "mcts:10", "mcts:50")
  c.train.checkpoint_every = 50
  return c


def plain_grpo(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The training settings of the tiny configs derived from this one (``tic_tac_toe_tiny``,
  ``calculator_tiny``): the random opponent, no imitation term, RoPE base 10000, lr 1e-3 decaying
  over 200 steps, 300 steps. The recipe above (opponent mix, imitation term, RoPE base, learning
  rate, length) is tuned and measured on Connect Four only; those runs keep the settings they
  were measured with."""
  c.env.game.opponent_mix = ()
  c.rl.loss.imitation_coef = 0.0
  c.model.rope.theta = 10000.0
  c.optim.learning_rate = 1e-3
  c.optim.decay_steps = 200
  c.train.num_steps = 300
  return c
