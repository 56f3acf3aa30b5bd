"""The KV cache of the decoder: per-row slots filled in time order.

Data flow: the sampler creates a cache with ``init_cache`` and threads it through
``Decoder.hidden`` (prefill, then one token per decode step, then the next turn's chunk). Each call
appends the *valid* tokens of its chunk, in order, at slots ``end_B, end_B + 1, ...`` of every row
and advances ``end_B`` by their count; padding tokens get no slot. So rows with different fill
levels (multi-turn continuation) are appended to independently, a row that has stopped decoding
consumes no slots, and every row's cache stays compact: slots ``[0, end_B)`` are exactly its
context. The RoPE positions are the caller's, so left, right or interior padding all work.

Everything here has static shapes and no Python control flow on values: it runs inside jit.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from earl_jax.model.config import ModelConfig
from earl_jax.types import BATCH, CACHE_SEQ, HEAD_DIM, KV_HEADS, LAYERS

# Logical axes of KVCache.k / KVCache.v, for the parallel layer to shard the cache.
# Heads before slots: a decode step's attention reads key blocks [B, K, Bk, Dh], the layout its
# batched dots take (slots before heads made XLA:CPU copy and transpose every layer's cache on
# every token: 1.6 s of 8.5 s generating 256 tokens at B 32, 31M parameters).
CACHE_KV_AXES: tuple[str, ...] = (LAYERS, BATCH, KV_HEADS, CACHE_SEQ, HEAD_DIM)
CACHE_VALID_AXES: tuple[str, ...] = (BATCH, CACHE_SEQ)
CACHE_END_AXES: tuple[str, ...] = (BATCH,)


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer, [L, B, K, S, Dh]; ``valid_BxS`` marks slots holding real tokens
  and ``end_B`` (int32) is the next slot each row writes to."""

  k: jax.Array
  v: jax.Array
  valid_BxS: jax.Array
  end_B: jax.Array

  @property
  def max_len(self) -> int:
    return self.k.shape[3]


def cache_partition_specs() -> KVCache:
  """PartitionSpecs of logical names for every KVCache field (as ``nnx.get_partition_spec`` gives
  for parameters), for the parallel layer to map to mesh axes."""
  kv = PartitionSpec(*CACHE_KV_AXES)
  return KVCache(
    k=kv, v=kv, valid_BxS=PartitionSpec(*CACHE_VALID_AXES), end_B=PartitionSpec(*CACHE_END_AXES)
  )


def init_cache(
  cfg: ModelConfig, batch_size: int, max_len: int, dtype: jnp.dtype | str | None = None
) -> KVCache:
  """An empty cache with ``max_len`` slots per row; ``dtype`` defaults to the compute dtype."""
  if batch_size < 1 or max_len < 1:
    raise ValueError(
      f"init_cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}"
    )
  dtype = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype.jnp
  shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
  return KVCache(
    k=jnp.zeros(shape, dtype),
    v=jnp.zeros(shape, dtype),
    valid_BxS=jnp.zeros((batch_size, max_len), jnp.bool_),
    end_B=jnp.zeros((batch_size,), jnp.int32),
  )


def resize_cache(cache: KVCache, max_len: int) -> KVCache:
  """The same cache with ``max_len`` slots per row: new slots are empty; a shorter cache drops
  the last slots, which the caller guarantees are empty (every row's ``end_B`` <= max_len)."""
  if max_len < 1:
    raise ValueError(f"resize_cache needs max_len >= 1, got {max_len}")
  extra = max_len - cache.max_len
  if extra >= 0:
    pad_kv = ((0, 0),) * 3 + ((0, extra), (0, 0))
    return cache.replace(
      k=jnp.pad(cache.k, pad_kv),
      v=jnp.pad(cache.v, pad_kv),
      valid_BxS=jnp.pad(cache.valid_BxS, ((0, 0), (0, extra))),
    )
  return cache.replace(
    k=cache.k[:, :, :, :max_len],
    v=cache.v[:, :, :, :max_len],
    valid_BxS=cache.valid_BxS[:, :max_len],
  )


def write_slots(cache: KVCache, mask_BxT: jax.Array) -> jax.Array:
  """Slots [B, T] of a chunk's tokens: valid tokens in order from ``end_B``; padding gets slot S.

  Slot S is past the end, so scatters with ``mode="drop"`` discard padding, and as a query a
  padding token sees every valid key (its output is never used).
  """
  rank_BxT = jnp.cumsum(mask_BxT.astype(jnp.int32), axis=1) - 1
  return jnp.where(mask_BxT, cache.end_B[:, None] + rank_BxT, cache.max_len).astype(jnp.int32)


def _row_index(slots_BxT: jax.Array) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(slots_BxT.shape[0], dtype=jnp.int32)[:, None], slots_BxT.shape)


def mark_written(cache: KVCache, slots_BxT: jax.Array, mask_BxT: jax.Array) -> KVCache:
  """The valid tokens' slots marked valid; ``end_B`` advanced by the number of valid tokens.

  Tokens past the last slot are dropped (static shapes cannot grow): callers must size the
  cache for the whole episode, as ``rl/rollout.py`` does (``end_B > max_len`` shows an overflow).
  """
  rows_BxT = _row_index(slots_BxT)
  valid_BxS = cache.valid_BxS.at[rows_BxT, slots_BxT].set(mask_BxT, mode="drop")
  added_B = jnp.sum(mask_BxT, axis=1, dtype=jnp.int32)
  return cache.replace(valid_BxS=valid_BxS, end_B=cache.end_B + added_B)


def write_layer(
  kv_LxBxKxSxDh: jax.Array, layer: int, slots_BxT: jax.Array, new_BxTxKxDh: jax.Array
) -> jax.Array:
  """Scatters one layer's new keys (or values) into the stacked cache, in place under donation."""
  rows_BxT = _row_index(slots_BxT)
  new_BxTxKxDh = new_BxTxKxDh.astype(kv_LxBxKxSxDh.dtype)
  # (layer, row, slot) index around the heads slice: the indexed shape is [B, T, K, Dh].
  return kv_LxBxKxSxDh.at[layer, rows_BxT, :, slots_BxT].set(new_BxTxKxDh, mode="drop")
