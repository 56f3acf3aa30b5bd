"""Building blocks of the decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Data flow: ``transformer.Decoder`` stacks ``Block``s (attention + MLP with pre-norms) between the
token embedding and the output projection. Every parameter is an ``nnx.Param`` carrying logical
axis names from ``earl_jax.types`` (never mesh axes); the parallel layer maps them per stage.

Numerics follow the HF Llama/Qwen2 reference so imported checkpoints reproduce its logits:
parameters are stored in ``param_dtype`` and cast to ``compute_dtype`` at use; RMSNorm, the
rotary rotation and the softmax run in float32 whatever the compute dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from earl_jax.model.config import ModelConfig, RopeConfig, RopeType
from earl_jax.model.layout import constrain
from earl_jax.types import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, MLP, NORM, SEQ

_INIT_STDDEV = 0.02  # HF initializer_range default; only used for from-scratch models


def param(value: jax.Array, *names: str) -> nnx.Param:
  """A parameter annotated with logical axis names (see the convention in DESIGN.md)."""
  if len(names) != value.ndim:
    raise ValueError(f"parameter of shape {value.shape} needs {value.ndim} axis names, got {names}")
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def dense(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
  """``x [..., *c] @ w [*c, *out]`` over the last ``contract`` axes of x, as one 2-D matmul.

  The same product as the einsum, written [M, K] @ [K, N] on purpose: XLA's CPU backend lowers the
  gradient of a 3-D ``"btd,df->btf"`` einsum with a materialised transpose of the [B*T, F]
  activation gradient for every weight gradient (about a quarter of an update step's time at 30M
  parameters), while the 2-D form uses the matmul's own transposed operands. Leading axes are
  merged only with unsharded ones after the batch axis, so the layout is unchanged.
  """
  lead, c = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :]
  if w.shape[:contract] != c:
    raise ValueError(f"dense: x {x.shape} and w {w.shape} do not share the {contract} axes {c}")
  k = math.prod(c)
  y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1))
  return y.reshape(*lead, *w.shape[contract:])


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
  return (_INIT_STDDEV * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale (``rms_norm``)."""

  def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype):
    self.eps = eps
    self.scale = param(jnp.ones((dim,), param_dtype), NORM)

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    return rms_norm(x_BxTxD, self.scale[...], self.eps)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) * scale, computed in float32 and cast back before the scale (as HF does).

  Rematerialised: the backward pass keeps ``x`` (and the scale) and recomputes the statistics and
  the normalised x, a few elementwise operations over [B, T, D]; the output is kept by the
  projection that reads it, for its weight gradient, as before. Left to autodiff, each norm kept
  two more [B, T, D] arrays (x / rms(x) and its scaled copy): 17 norms of the 31M Qwen2 update of
  32 x 288 tokens held 0.6 GiB of its compiled temp memory (4,458 -> 3,847 MiB on XLA:CPU)."""
  x32_BxTxD = x_BxTxD.astype(jnp.float32)
  ms_BxTx1 = jnp.mean(jnp.square(x32_BxTxD), axis=-1, keepdims=True)
  normed_BxTxD = (x32_BxTxD * jax.lax.rsqrt(ms_BxTx1 + eps)).astype(x_BxTxD.dtype)
  return normed_BxTxD * scale_D.astype(x_BxTxD.dtype)[None, None]


# ----------------------------------------------------------------------------------------------
# Rotary embeddings


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """Inverse frequencies [Dh/2] in float32, step for step as HF computes them.

  DEFAULT: ``1 / theta ** (2i / Dh)``. LLAMA3: HF ``_compute_llama3_parameters`` (Llama 3.1):
  long wavelengths are divided by ``factor``, short ones kept, the band between interpolated.
  """
  f32 = np.float32
  exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
  inv_freq = (f32(1.0) / np.power(f32(rope.theta), exponent)).astype(f32)
  if rope.type == RopeType.DEFAULT:
    return inv_freq
  if rope.type != RopeType.LLAMA3:
    raise ValueError(f"unsupported rope type {rope.type}; allowed: {[t.value for t in RopeType]}")
  factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
  old_len = rope.original_max_position_embeddings
  low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
  wavelen = (f32(2 * math.pi) / inv_freq).astype(f32)
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / f32(factor), inv_freq).astype(f32)
  smooth = ((f32(old_len) / wavelen - f32(low)) / f32(high - low)).astype(f32)
  smoothed = ((f32(1) - smooth) * scaled / f32(factor) + smooth * scaled).astype(f32)
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(f32)


def rope_tables(positions_BxT: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables [B, T, Dh] (HF layout: the Dh/2 frequencies repeated twice), float32."""
  freqs_BxTxDh2 = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
  emb_BxTxDh = jnp.concatenate([freqs_BxTxDh2, freqs_BxTxDh2], axis=-1)
  return jnp.cos(emb_BxTxDh), jnp.sin(emb_BxTxDh)


def apply_rope(x_BxTxNxDh: jax.Array, cos_BxTxDh: jax.Array, sin_BxTxDh: jax.Array) -> jax.Array:
  """Rotates the pairs (i, i + Dh/2) of every head (HF ``rotate_half`` convention), in float32."""
  x32 = x_BxTxNxDh.astype(jnp.float32)
  half = x32.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  cos, sin = cos_BxTxDh[:, :, None, :], sin_BxTxDh[:, :, None, :]
  return (x32 * cos + rotated * sin).astype(x_BxTxNxDh.dtype)


# ----------------------------------------------------------------------------------------------
# Attention projections (the kernels are in attention.py)


class Attention(nnx.Module):
  """Projections of grouped-query attention (optional q/k/v bias, as Qwen2); no o bias."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, k, dh = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pdt = cfg.param_dtype.jnp
    self.compute_dtype = cfg.compute_dtype.jnp
    self.q = param(normal_init(rngs, (d, h, dh), pdt), EMBED, HEADS, HEAD_DIM)
    self.k = param(normal_init(rngs, (d, k, dh), pdt), EMBED, KV_HEADS, HEAD_DIM)
    self.v = param(normal_init(rngs, (d, k, dh), pdt), EMBED, KV_HEADS, HEAD_DIM)
    self.o = param(normal_init(rngs, (h, dh, d), pdt), HEADS, HEAD_DIM, EMBED)
    if cfg.qkv_bias:
      self.q_bias = param(jnp.zeros((h, dh), pdt), HEADS, HEAD_DIM)
      self.k_bias = param(jnp.zeros((k, dh), pdt), KV_HEADS, HEAD_DIM)
      self.v_bias = param(jnp.zeros((k, dh), pdt), KV_HEADS, HEAD_DIM)
    else:
      self.q_bias = self.k_bias = self.v_bias = None

  def _project(self, x_BxTxD: jax.Array, w: nnx.Param, b: nnx.Param | None) -> jax.Array:
    out_BxTxNxDh = dense(x_BxTxD, w[...].astype(self.compute_dtype))
    if b is not None:
      out_BxTxNxDh = out_BxTxNxDh + b[...].astype(self.compute_dtype)[None, None]
    return out_BxTxNxDh

  def qkv(
    self, x_BxTxD: jax.Array, cos_BxTxDh: jax.Array, sin_BxTxDh: jax.Array
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries [B,T,H,Dh], rotated keys and values [B,T,K,Dh] of the new tokens."""
    q = apply_rope(self._project(x_BxTxD, self.q, self.q_bias), cos_BxTxDh, sin_BxTxDh)
    k = apply_rope(self._project(x_BxTxD, self.k, self.k_bias), cos_BxTxDh, sin_BxTxDh)
    v = self._project(x_BxTxD, self.v, self.v_bias)
    kv_axes = (BATCH, SEQ, KV_HEADS, HEAD_DIM)
    return constrain(q, (BATCH, SEQ, HEADS, HEAD_DIM)), constrain(k, kv_axes), constrain(v, kv_axes)

  def out(self, attn_BxTxHxDh: jax.Array) -> jax.Array:
    return dense(attn_BxTxHxDh, self.o[...].astype(self.compute_dtype), contract=2)


@jax.checkpoint
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up, rematerialised: the backward pass keeps only ``gate`` and ``up`` and
  recomputes the sigmoid and the product (the down projection's input) from them, a few
  elementwise operations. Left to autodiff, the MLP keeps five [B, T, F] arrays per layer for the
  backward pass instead of two (silu's sigmoid and products); for the 31M Qwen2 update of 32 x 288
  tokens on XLA:CPU that was 0.4 GiB (7%) of the compiled temp memory."""
  return jax.nn.silu(gate) * up


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, pdt = cfg.embed_dim, cfg.mlp_dim, cfg.param_dtype.jnp
    self.compute_dtype = cfg.compute_dtype.jnp
    self.gate = param(normal_init(rngs, (d, f), pdt), EMBED, MLP)
    self.up = param(normal_init(rngs, (d, f), pdt), EMBED, MLP)
    self.down = param(normal_init(rngs, (f, d), pdt), MLP, EMBED)

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    cdt = self.compute_dtype
    gate_BxTxF = dense(x_BxTxD, self.gate[...].astype(cdt))
    up_BxTxF = dense(x_BxTxD, self.up[...].astype(cdt))
    hidden_BxTxF = constrain(swiglu(gate_BxTxF, up_BxTxF), (BATCH, SEQ, MLP))
    return dense(hidden_BxTxF, self.down[...].astype(cdt))
