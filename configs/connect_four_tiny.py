"""Connect Four with a tiny from-scratch character-level policy: the default run, on CPU.

The policy sees only the opponent's last move each turn ("moves" observation: the board is the
history of the episode), answers with one column digit, and plays against a random opponent. It
is evaluated greedily against random, the one-ply heuristic and MCTS with 10 simulations, next to
scripted baselines played on the same episodes (printed at start-up, dashed in the plots): in
this budget it learns about as much as the best single column does against random.

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
  c.model.max_seq_len = 256
  c.tokenizer.kind = "char"

  c.env.game.observation = "moves"
  c.env.game.parse_mode = "lenient"  # the first digit run is the column
  # Rewards: a win 1, a draw or a loss 0, -0.05 per unreadable or illegal answer (asked again,
  # up to 4 times in a row) and -1 for forfeiting by a fifth. From scratch the policy first
  # learns to answer legally, then to win; giving up is always the worst outcome.
  c.env.game.on_invalid = "retry"
  c.env.game.max_retries = 4
  c.env.game.invalid_penalty = -0.05
  c.env.game.forfeit_reward = -1.0
  c.env.game.win_reward = 1.0
  c.env.game.draw_reward = 0.0
  c.env.game.loss_reward = 0.0

  c.sampler.temperature = 1.0
  c.rollout.num_slots = 32
  c.rollout.max_turns = 24  # a Connect Four game has at most 21 moves per side
  c.rollout.max_new_tokens = 2  # a column digit and <end>
  c.rollout.max_context = 256
  c.rollout.chunk_multiple = 8
  c.rollout.seq_multiple = 64

  c.rl.num_groups = 8
  c.rl.group_size = 4
  c.rl.logp_chunk = 64
  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 5
  c.optim.decay_steps = 200
  c.optim.end_lr_ratio = 0.2

  c.train.num_steps = 400
  c.train.eval_every = 50
  c.train.eval_episodes = 64
  c.train.eval_opponents = ("random", "heuristic", "mcts:10")
  c.train.baselines = ("column", "heuristic", "mcts:10", "mcts:50")
  c.train.checkpoint_every = 50
  return c
