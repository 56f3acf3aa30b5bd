"""Model presets for planning without checkpoints: the selector CLI and the paper-scale projection.

Data flow: ``python -m earl_jax.parallel.selector --model <preset | config.json>`` resolves the
model here, then plans with the analytic memory/cost model; nothing is allocated, so a 72B plan
for a 128-GPU pool can be made on a laptop. The numbers are the public HF ``config.json`` values
of each model (bf16 weights and compute).
"""

from __future__ import annotations

import json
import os

from earl_jax.model.config import ModelConfig, RopeConfig, RopeType
from earl_jax.types import ConfigError, DType

_BF16 = {"param_dtype": DType.BFLOAT16, "compute_dtype": DType.BFLOAT16}
_LLAMA31_ROPE = RopeConfig(theta=500000.0, type=RopeType.LLAMA3, factor=8.0)

PRESETS: dict[str, ModelConfig] = {
  "qwen2.5-72b": ModelConfig(
    vocab_size=152064,
    embed_dim=8192,
    mlp_dim=29568,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=1e6),
    qkv_bias=True,
    max_seq_len=32768,
    **_BF16,
  ),
  "qwen2.5-7b": ModelConfig(
    vocab_size=152064,
    embed_dim=3584,
    mlp_dim=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=1e6),
    qkv_bias=True,
    max_seq_len=32768,
    **_BF16,
  ),
  "qwen2.5-0.5b": ModelConfig(
    vocab_size=151936,
    embed_dim=896,
    mlp_dim=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=1e6),
    qkv_bias=True,
    tie_embeddings=True,
    max_seq_len=32768,
    **_BF16,
  ),
  "llama-3.1-8b": ModelConfig(
    vocab_size=128256,
    embed_dim=4096,
    mlp_dim=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope=_LLAMA31_ROPE,
    max_seq_len=131072,
    **_BF16,
  ),
  "llama-3.1-70b": ModelConfig(
    vocab_size=128256,
    embed_dim=8192,
    mlp_dim=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope=_LLAMA31_ROPE,
    max_seq_len=131072,
    **_BF16,
  ),
}


def resolve_model(name_or_path: str, *, dtype: str = "bfloat16") -> ModelConfig:
  """A preset name, or a HF ``config.json`` path (or a directory holding one)."""
  if name_or_path in PRESETS:
    return PRESETS[name_or_path]
  path = name_or_path
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  if not os.path.isfile(path):
    raise ConfigError(
      "model", name_or_path, f"one of the presets {sorted(PRESETS)} or a path to a config.json"
    )
  from earl_jax.model.hf_import import model_config_from_hf  # heavy import only when needed

  with open(path) as f:
    hf = json.load(f)
  settings = ModelConfig(
    param_dtype=DType(dtype),
    compute_dtype=DType(dtype),
    max_seq_len=int(hf.get("max_position_embeddings", 2048)),
  )
  return model_config_from_hf(hf, settings)
