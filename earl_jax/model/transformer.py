"""The policy/reference decoder (Llama/Qwen2 family) as one Flax NNX module.

Data flow: the sampler (rollout stage) calls ``Decoder.hidden`` + ``Decoder.project`` with a KV
cache inside its jitted decode loop; the reference and update stages call ``hidden`` without a
cache and project the hidden states chunk by chunk (never materialising [B, T, V] at once).
``hf_import.from_pretrained`` fills a Decoder with HF checkpoint weights.

Logits always come out in float32 (the lm-head matmul accumulates in f32) with ``padded_vocab_size``
columns; the padding columns hold ``PAD_LOGIT`` so sampling and log-softmax never pick them.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from earl_jax.model import attention, kv_cache
from earl_jax.model.config import ModelConfig
from earl_jax.model.kv_cache import KVCache
from earl_jax.model.layers import (
  Attention,
  RMSNorm,
  SwiGLU,
  normal_init,
  param,
  rope_inv_freq,
  rope_tables,
)
from earl_jax.model.layout import constrain
from earl_jax.types import BATCH, EMBED, LAYERS, SEQ, VOCAB

# Finite (not -inf): exp() underflows to exactly 0, while p * log p and differences stay finite,
# so entropies and KL terms over the padded vocabulary never become NaN.
PAD_LOGIT = -1e9

REMAT_POLICIES = {
  "full": None,  # save nothing inside a block: recompute it all in the backward pass
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}
_KV = tuple[jax.Array, jax.Array]
_RESIDUAL = (BATCH, SEQ, None)  # the residual stream: rows sharded, width replicated


@flax.struct.dataclass
class Visibility:
  """What each query sees (see ``attention``): its slot (-1 = padding, sees nothing), the valid
  key slots, and with a cache the slots where the new keys are written (S = dropped)."""

  q_slots_BxT: jax.Array
  k_valid_BxS: jax.Array
  write_slots_BxT: jax.Array


class Block(nnx.Module):
  """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pdt = cfg.param_dtype.jnp
    self.attention, self.attention_block = cfg.attention, cfg.attention_block
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.rms_norm_eps, param_dtype=pdt)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.rms_norm_eps, param_dtype=pdt)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(
    self,
    x_BxTxD: jax.Array,
    rope_BxTxDh: tuple[jax.Array, jax.Array],
    vis: Visibility,
    kv: _KV | None,
    layer: jax.Array,
  ) -> tuple[jax.Array, _KV | None]:
    """Without a cache the keys are the T new tokens; with one (``kv`` = the stacked cache
    arrays) the new keys are written into ``layer`` and attention reads the cache's blocks."""
    q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh = self.attn.qkv(self.attn_norm(x_BxTxD), *rope_BxTxDh)
    kernel = {"implementation": self.attention, "block_size": self.attention_block}
    if kv is None:
      attn_BxTxHxDh = attention.attend(
        q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, vis.q_slots_BxT, vis.k_valid_BxS, **kernel
      )
    else:
      kv = (
        kv_cache.write_layer(kv[0], layer, vis.write_slots_BxT, k_BxTxKxDh),
        kv_cache.write_layer(kv[1], layer, vis.write_slots_BxT, v_BxTxKxDh),
      )
      attn_BxTxHxDh = attention.attend(
        q_BxTxHxDh, *kv, vis.q_slots_BxT, vis.k_valid_BxS, layer=layer, **kernel
      )
    x_BxTxD = constrain(x_BxTxD + self.attn.out(attn_BxTxHxDh), _RESIDUAL)
    x_BxTxD = constrain(x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD)), _RESIDUAL)
    return x_BxTxD, kv


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """``num_layers`` Blocks as one module whose parameters have a leading ``layers`` axis."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
  def make(rngs: nnx.Rngs) -> Block:
    return Block(cfg, rngs=rngs)

  return make(rngs)


class Decoder(nnx.Module):
  """Token embedding, ``num_layers`` Blocks (stacked, run by a scan), final RMSNorm, output
  projection (tied or not)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt, vp, d = cfg.param_dtype.jnp, cfg.padded_vocab_size, cfg.embed_dim
    self.embed = param(normal_init(rngs, (vp, d), pdt), VOCAB, EMBED)
    self.blocks = _stacked_blocks(cfg, rngs)
    self.final_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=pdt)
    self.lm_head = (
      None if cfg.tie_embeddings else param(normal_init(rngs, (d, vp), pdt), EMBED, VOCAB)
    )

  def _check_inputs(
    self, tokens_BxT: jax.Array, positions_BxT: jax.Array, mask_BxT: jax.Array, remat: str
  ) -> None:
    if remat not in ("none", *REMAT_POLICIES):
      raise ValueError(f"remat={remat!r}; allowed: 'none', {', '.join(map(repr, REMAT_POLICIES))}")
    for name, arr in (("positions_BxT", positions_BxT), ("mask_BxT", mask_BxT)):
      if arr.shape != tokens_BxT.shape:
        raise ValueError(
          f"{name} has shape {arr.shape}; it must match tokens_BxT {tokens_BxT.shape}"
        )

  def layer_states(self) -> list[nnx.State]:
    """The stacked blocks' parameters split into one state per layer, for ``hidden(layers=...)``
    in a loop of many steps (the decode loop): sliced once, outside the loop."""
    _, state = nnx.split(self.blocks)
    return [jax.tree.map(lambda a, i=i: a[i], state) for i in range(self.cfg.num_layers)]

  def _run_blocks(
    self,
    x_BxTxD: jax.Array,
    rope: tuple,
    vis: Visibility,
    kv: _KV | None,
    remat: str,
    layers: list[nnx.State] | None = None,
  ) -> tuple[jax.Array, _KV | None]:
    """All layers: one ``lax.scan`` over the stacked parameters, so the program holds one copy
    of the block whatever the depth; or unrolled (``cfg.forward_layers``), or over ``layers``
    already split per layer. The KV cache rides in the carry and each layer writes its own slice
    in place."""
    graphdef, state = nnx.split(self.blocks)

    def body(carry, xs):
      x_BxTxD, kv = carry
      layer_state, layer = xs
      return nnx.merge(graphdef, layer_state)(x_BxTxD, rope, vis, kv, layer), None

    if remat != "none":
      # Only ever scanned (``unrolled_forward``), where XLA cannot merge the recomputation with
      # the forward pass: the checkpoint docs' setting for a scan body.
      body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    if layers is None and not self.cfg.unrolled_forward(jax.default_backend(), remat):
      indices = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
      (x_BxTxD, kv), _ = jax.lax.scan(body, (x_BxTxD, kv), (state, indices))
      return x_BxTxD, kv
    for i, layer_state in enumerate(self.layer_states() if layers is None else layers):
      (x_BxTxD, kv), _ = body((x_BxTxD, kv), (layer_state, jnp.int32(i)))
    return x_BxTxD, kv

  def hidden(
    self,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    *,
    mask_BxT: jax.Array,
    cache: KVCache | None = None,
    remat: str = "none",
    layers: list[nnx.State] | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """Final-normed hidden states [B, T, D] (compute dtype) and the updated cache.

    Without a cache, token t attends to the valid tokens <= t of its row. With a cache, the
    valid tokens (``mask_BxT``) are appended in order at slots ``end_B ..`` of each row, ``end_B``
    advances by their count, and each token attends to the valid slots <= its own. Padding
    tokens attend to nothing (their hidden states are meaningless and never read).
    ``positions_BxT`` are the RoPE positions. ``remat`` ("none" | "full" | "dots") is static.
    ``layers``: the blocks' parameters from ``layer_states()``, run unrolled (the decode loop).
    """
    self._check_inputs(tokens_BxT, positions_BxT, mask_BxT, remat)
    cfg, t = self.cfg, tokens_BxT.shape[1]
    x_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(cfg.compute_dtype.jnp)
    x_BxTxD = constrain(x_BxTxD, _RESIDUAL)
    rope_BxTxDh = rope_tables(positions_BxT, rope_inv_freq(cfg.rope, cfg.head_dim))
    mask_BxT = mask_BxT.astype(jnp.bool_)
    if cache is None:
      slots_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], tokens_BxT.shape)
      vis = Visibility(jnp.where(mask_BxT, slots_BxT, -1), mask_BxT, slots_BxT)
      kv = None
    else:
      slots_BxT = kv_cache.write_slots(cache, mask_BxT)
      cache = kv_cache.mark_written(cache, slots_BxT, mask_BxT)
      vis = Visibility(jnp.where(mask_BxT, slots_BxT, -1), cache.valid_BxS, slots_BxT)
      kv = (cache.k, cache.v)
    x_BxTxD, kv = self._run_blocks(x_BxTxD, rope_BxTxDh, vis, kv, remat, layers)
    if cache is not None:
      cache = cache.replace(k=kv[0], v=kv[1])
    return self.final_norm(x_BxTxD), cache

  def project(self, h_BxTxD: jax.Array) -> jax.Array:
    """Logits [B, T, padded_vocab_size] in float32; padding columns are ``PAD_LOGIT``."""
    cfg = self.cfg
    h_BxTxD = h_BxTxD.astype(cfg.compute_dtype.jnp)
    b, t, d = h_BxTxD.shape
    h_MxD = h_BxTxD.reshape(b * t, d)  # 2-D: see layers.dense (no transposed copies on CPU)
    if self.lm_head is None:
      w = self.embed[...].astype(h_BxTxD.dtype)  # [V, D]
      dims = (((1,), (1,)), ((), ()))
    else:
      w = self.lm_head[...].astype(h_BxTxD.dtype)  # [D, V]
      dims = (((1,), (0,)), ((), ()))
    logits_MxV = jax.lax.dot_general(h_MxD, w, dims, preferred_element_type=jnp.float32)
    logits_BxTxV = logits_MxV.reshape(b, t, -1)
    real_1x1xV = (jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size)[None, None, :]
    return jnp.where(real_1x1xV, logits_BxTxV, PAD_LOGIT)

  def __call__(
    self,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    *,
    mask_BxT: jax.Array,
    cache: KVCache | None = None,
    remat: str = "none",
  ) -> tuple[jax.Array, KVCache | None]:
    """``project(hidden(...))``: (logits [B, T, padded_vocab_size] float32, cache)."""
    h_BxTxD, cache = self.hidden(
      tokens_BxT, positions_BxT, mask_BxT=mask_BxT, cache=cache, remat=remat
    )
    return self.project(h_BxTxD), cache


def logits(model: Decoder, tokens_BxT: jax.Array) -> jax.Array:
  """Full causal forward without cache (positions 0..T-1, every token valid): [B, T, vocab_size]."""
  b, t = tokens_BxT.shape
  positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
  mask_BxT = jnp.ones((b, t), jnp.bool_)
  out_BxTxVp, _ = model(tokens_BxT, positions_BxT, mask_BxT=mask_BxT)
  return out_BxTxVp[..., : model.cfg.vocab_size]


def prefill(
  model: Decoder,
  cache: KVCache,
  tokens_BxT: jax.Array,
  positions_BxT: jax.Array,
  mask_BxT: jax.Array,
) -> tuple[jax.Array, KVCache]:
  """Appends a chunk to every row of the cache: (logits [B, T, padded_vocab_size], cache)."""
  return model(tokens_BxT, positions_BxT, mask_BxT=mask_BxT, cache=cache)


def decode_step(
  model: Decoder,
  cache: KVCache,
  token_B: jax.Array,
  position_B: jax.Array,
  active_B: jax.Array,
) -> tuple[jax.Array, KVCache]:
  """One token per row (written as valid where ``active_B``): (logits [B, padded_vocab], cache)."""
  logits_Bx1xV, cache = model(
    token_B[:, None], position_B[:, None], mask_BxT=active_B[:, None], cache=cache
  )
  return logits_Bx1xV[:, 0], cache
