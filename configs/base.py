"""The full config schema of earl_jax: every key, its one default and a one-line comment.

Experiment files derive from this (``config = base.get_config()`` then override); they never
declare new keys. ``earl_jax.config_lib.from_config_dict`` validates the result before any compute.

Launch: python launch/train.py --config=configs/base.py
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # root PRNG seed: params init, sampling and environment seeds derive from it
  c.pretrained_path = (
    ""  # HF directory or hub repo id; when set, `model` is read from its config.json
  )

  m = c.model = ml_collections.ConfigDict()
  m.vocab_size = 256  # tokenizer vocabulary size (embedding rows before padding)
  m.embed_dim = 64  # D: residual stream width (HF hidden_size)
  m.mlp_dim = 128  # F: SwiGLU hidden width (HF intermediate_size)
  m.num_layers = 2  # L: decoder blocks
  m.num_heads = 4  # H: query heads
  m.num_kv_heads = 2  # K: key/value heads; must divide num_heads (grouped-query attention)
  m.head_dim = 16  # Dh: per-head width; even (RoPE rotates pairs)
  m.rms_norm_eps = 1e-6  # RMSNorm epsilon
  m.qkv_bias = False  # biases on q/k/v projections (Qwen2 uses them)
  m.tie_embeddings = False  # output projection shares the embedding table
  m.max_seq_len = 2048  # longest context (prompt + every turn) the model is asked to handle
  m.vocab_multiple = 128  # embedding rows are padded up to a multiple of this (tensor parallelism)
  m.param_dtype = "float32"  # parameter storage dtype: float32 | bfloat16
  m.compute_dtype = "float32"  # matmul dtype: float32 | bfloat16 (softmax and norms stay float32)

  r = m.rope = ml_collections.ConfigDict()
  r.theta = 10000.0  # RoPE base (HF rope_theta)
  r.type = "default"  # default | llama3 (Llama-3.1 frequency scaling)
  r.factor = 8.0  # llama3: wavelength scaling factor
  r.low_freq_factor = 1.0  # llama3: low-frequency factor
  r.high_freq_factor = 4.0  # llama3: high-frequency factor
  r.original_max_position_embeddings = 8192  # llama3: context length of the base model

  t = c.tokenizer = ml_collections.ConfigDict()
  t.kind = "char"  # char (built-in, no files) | hf (tokenizer.json from `path`)
  t.path = ""  # hf: directory or hub repo id holding tokenizer.json / tokenizer_config.json
  return c
