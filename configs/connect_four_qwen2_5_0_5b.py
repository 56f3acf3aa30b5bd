"""Connect Four with Qwen2.5-0.5B-Instruct on one GPU or a small TPU slice.

Launch (single host):
  python launch/train.py --config=configs/connect_four_qwen2_5_0_5b.py --workdir=/tmp/c4_qwen05b
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  c = base.get_config()
  c.pretrained_path = "Qwen/Qwen2.5-0.5B-Instruct"  # a hub id or a local HF directory
  c.tokenizer.kind = "hf"
  c.model.param_dtype = "float32"  # master weights and Adam moments: lr 1e-6 needs float32
  c.model.compute_dtype = "bfloat16"
  c.model.max_seq_len = 8192

  c.env.game.observation = "verbose"
  c.env.game.parse_mode = "tag"
  c.env.game.opponent = "mcts"
  c.env.game.mcts_simulations = 50

  c.sampler.temperature = 1.0
  c.rollout.num_slots = 64
  c.rollout.max_turns = 24
  c.rollout.max_new_tokens = 512
  c.rollout.max_context = 8192
  c.rollout.chunk_multiple = 64
  c.rollout.seq_multiple = 1024
  c.rl.num_groups = 16
  c.rl.group_size = 8
  c.rl.logp_chunk = 512
  c.rl.loss.kl_beta = 0.001
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.optim.decay_steps = 500
  c.optim.weight_decay = 0.01
  c.parallel.update_layout.remat = "full"
  c.parallel.update_layout.micro_batch_size = 16
  c.train.num_steps = 500
  c.train.eval_every = 25
  c.train.eval_episodes = 64
  c.train.eval_opponents = ("random", "mcts")
  return c
