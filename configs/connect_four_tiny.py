"""Connect Four with a tiny from-scratch character-level policy; the default run, on CPU.

Launch: python launch/train.py --config=configs/connect_four_tiny.py
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  c = base.get_config()
  c.model.vocab_size = 105  # exactly the built-in character tokenizer (CharTokenizer().vocab_size)
  c.model.embed_dim = 96
  c.model.mlp_dim = 256
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 24
  c.model.max_seq_len = 512
  c.tokenizer.kind = "char"
  return c
