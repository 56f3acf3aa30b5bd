"""The model's own configuration: the decoder's shape and numerics, and which tokenizer it reads.

Validated on construction (``ConfigError`` names the key, the value and what is allowed);
``earl_jax.config_lib`` builds these from the experiment config files and re-exports them.
Importing this module loads no environment or RL code.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from earl_jax.types import ConfigError, DType


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
  if not ok:
    raise ConfigError(key, value, allowed)


def _unrolled(loop: str, backend: str) -> bool:
  """A layer-loop key's value ("auto" | "scan" | "unrolled") resolved on ``backend``: "auto"
  unrolls on CPU only."""
  return loop == "unrolled" or (loop == "auto" and backend == "cpu")


class RopeType(enum.Enum):
  DEFAULT = "default"  # plain RoPE with rope_theta
  LLAMA3 = "llama3"  # Llama-3.1 frequency-dependent scaling of the inverse frequencies


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding parameters (HF ``rope_theta`` / ``rope_scaling`` / ``rope_parameters``)."""

  theta: float = 10000.0
  type: RopeType = RopeType.DEFAULT
  factor: float = 8.0  # llama3 only: overall wavelength scaling
  low_freq_factor: float = 1.0  # llama3 only
  high_freq_factor: float = 4.0  # llama3 only
  original_max_position_embeddings: int = 8192  # llama3 only: context the base model was trained at

  def __post_init__(self):
    _require(self.theta > 0, "theta", self.theta, "a positive float")
    _require(self.factor >= 1.0, "factor", self.factor, "a float >= 1")
    _require(self.low_freq_factor > 0, "low_freq_factor", self.low_freq_factor, "a positive float")
    _require(
      self.high_freq_factor > self.low_freq_factor,
      "high_freq_factor",
      self.high_freq_factor,
      f"a float > low_freq_factor ({self.low_freq_factor})",
    )
    _require(
      self.original_max_position_embeddings > 0,
      "original_max_position_embeddings",
      self.original_max_position_embeddings,
      "a positive int",
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder of the Llama / Qwen2 family.

  ``vocab_size`` is the tokenizer's vocabulary; the embedding table has ``padded_vocab_size`` rows
  (rounded up to ``vocab_multiple``) so the vocab dimension divides any tensor-parallel size that
  divides ``vocab_multiple``. Padded logits are masked, never sampled.
  """

  vocab_size: int = 256
  embed_dim: int = 64  # D, HF hidden_size
  mlp_dim: int = 128  # F, HF intermediate_size
  num_layers: int = 2  # L
  num_heads: int = 4  # H
  num_kv_heads: int = 2  # K; H % K == 0 (grouped-query attention)
  head_dim: int = 16  # Dh; HF default is embed_dim // num_heads
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
  qkv_bias: bool = False  # Qwen2: True
  tie_embeddings: bool = False  # output projection shares the embedding table
  max_seq_len: int = 2048  # longest context (prompt + all turns) the model is asked to handle
  vocab_multiple: int = 128  # pad the embedding rows up to a multiple of this
  param_dtype: DType = DType.FLOAT32  # master weights (and so Adam moments); keep float32
  compute_dtype: DType = DType.FLOAT32  # matmul/activation dtype (bfloat16 on accelerators)
  attention: str = "auto"  # auto | naive | chunked | cudnn | splash (model/attention.py)
  attention_block: int = 512  # query/key block of the chunked and splash kernels
  # The full-sequence forward (prefill, reference, update) over the stacked blocks: "scan" runs
  # one lax.scan (the program holds one block whatever the depth: compile time and program size
  # independent of depth, what accelerators run); "unrolled" runs each layer on its slice of the
  # stack (XLA:CPU zero-fills and copies the scan's stacked per-layer residuals: ~2 s of the 30M
  # update step's ~13 there); "auto" = unrolled on CPU, scan elsewhere. A rematerialised forward
  # always scans: unrolled, XLA:CPU's compiled peak grew with depth as if nothing were remat'd.
  forward_layers: str = "auto"
  # The token-by-token decode loop: "scan" runs the stacked blocks with lax.scan (each step slices
  # every layer's weights out of the stack); "unrolled" slices them once per generate call and
  # runs the layers unrolled (faster on CPU, where XLA copies each slice; compiles a body per
  # layer); "auto" = unrolled on CPU, scan elsewhere.
  decode_layers: str = "auto"

  def __post_init__(self):
    for key in ("vocab_size", "embed_dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads"):
      value = getattr(self, key)
      _require(value > 0, key, value, "a positive int")
    _require(self.head_dim > 0, "head_dim", self.head_dim, "a positive int")
    _require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "an even int (RoPE rotates pairs)")
    _require(
      self.num_heads % self.num_kv_heads == 0,
      "num_kv_heads",
      self.num_kv_heads,
      f"a divisor of num_heads={self.num_heads}",
    )
    _require(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "a positive float")
    _require(self.max_seq_len > 0, "max_seq_len", self.max_seq_len, "a positive int")
    _require(self.vocab_multiple > 0, "vocab_multiple", self.vocab_multiple, "a positive int")
    impls = ("auto", "naive", "chunked", "cudnn", "splash")
    _require(self.attention in impls, "attention", self.attention, " | ".join(impls))
    _require(self.attention_block > 0, "attention_block", self.attention_block, "a positive int")
    loops = ("auto", "scan", "unrolled")
    _require(self.decode_layers in loops, "decode_layers", self.decode_layers, " | ".join(loops))
    _require(self.forward_layers in loops, "forward_layers", self.forward_layers, " | ".join(loops))

  def unrolled_forward(self, backend: str, remat: str = "none") -> bool:
    """Whether the full-sequence forward runs the layers unrolled (``forward_layers``) on
    ``backend`` with the update plan's ``remat`` policy (any but "none" scans)."""
    return remat == "none" and _unrolled(self.forward_layers, backend)

  def unrolled_decode(self, backend: str) -> bool:
    """Whether the decode loop runs per-layer weight copies (``decode_layers``) on ``backend``."""
    return _unrolled(self.decode_layers, backend)

  @property
  def padded_vocab_size(self) -> int:
    m = self.vocab_multiple
    return -(-self.vocab_size // m) * m

  @property
  def num_params(self) -> int:
    """Parameter count (padded vocab included), used by memory models."""
    d, f, h, k, dh = self.embed_dim, self.mlp_dim, self.num_heads, self.num_kv_heads, self.head_dim
    attn = d * h * dh + 2 * d * k * dh + h * dh * d
    if self.qkv_bias:
      attn += h * dh + 2 * k * dh
    per_layer = attn + 3 * d * f + 2 * d
    emb = self.padded_vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * per_layer + emb + d


class TokenizerKind(enum.Enum):
  CHAR = "char"  # built-in character tokenizer for tiny from-scratch models; needs no files
  HF = "hf"  # tokenizer.json (+ tokenizer_config.json chat template) from `path`


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  kind: TokenizerKind = TokenizerKind.CHAR
  path: str = ""  # HF: local directory or hub repo id holding tokenizer.json ("" = pretrained_path)
