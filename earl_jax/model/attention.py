"""Grouped-query attention kernels of the decoder, chosen by ``ModelConfig.attention``.

Data flow: ``transformer.Block`` projects queries/keys/values and calls ``attend`` with the
visibility of every key described by two small arrays, never by a [B, T, S] mask:
  q_slots_BxT   the slot each query occupies; key slot s is visible to it iff s <= q_slot.
                -1 marks a padding query: it sees nothing and its output is 0.
  k_valid_BxS   True on key slots that hold a real token.
Without a cache the slots are the sequence positions (causal); with the KV cache they are cache
slots, so multi-turn continuation, left/right/interior padding and unfilled cache slots are all
the same rule. Every implementation returns the same values (tested to 1e-5 in float32):

  naive    materialises the [B, K, G, T, S] scores: the reference, and fast for tiny T. Without
           a cache ``attend`` runs it in static causal query blocks (``causal_blocks``): block i
           multiplies only the keys up to its last query (60% of the scores at T 288).
  chunked  blockwise online softmax (FlashAttention-2 in plain JAX) with a hand-written backward
           pass: memory O(T) in forward and gradient; key blocks past the last visible slot of a
           query block are never visited (causal blocks and unfilled cache slots are skipped).
  cudnn    ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, bf16/fp16, no cache):
           causal with per-row lengths, so it needs packed (right-padded) rows, which is what
           the reference and update stages feed.
  splash   Pallas splash attention (TPU, no cache): causal mask with segment ids for padding.
  auto     splash on TPU and cudnn on GPU where they apply (no cache, T a multiple of 128); on
           CPU naive where the whole sequence is one block (no cache, T <= ``block_size``: the
           chunked kernel would visit a single block anyway, and its loops and hand-written
           backward cost 1.7x naive's time there, measured on one 30M layer, B 32, T 288);
           else chunked.

Scores, the softmax and its statistics are float32 whatever the compute dtype; the probabilities
are cast to the value dtype for the P @ V product, as in the naive path.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "naive", "chunked", "cudnn", "splash")

# Finite masked score: masked entries get exp(-1e30 - m) == 0 exactly, and a row that sees no key
# at all never produces inf - inf.
_MASKED = -1e30


def attend(
  q_BxTxHxDh: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_slots_BxT: jax.Array,
  k_valid_BxS: jax.Array,
  *,
  implementation: str = "chunked",
  block_size: int = 512,
  layer: jax.Array | None = None,
) -> jax.Array:
  """Attention output [B, T, H, Dh] in the query dtype.

  ``k``/``v`` are [B, S, K, Dh], or the stacked KV cache [L, B, K, S, Dh] together with ``layer``
  (forward only; key blocks past the last visible slot are never visited).
  """
  impl = resolve(
    implementation, cached=layer is not None, seq_len=q_BxTxHxDh.shape[1], block_size=block_size
  )
  if impl == "naive":
    if layer is not None:  # the cache is head-major already
      return _naive_head_major(q_BxTxHxDh, k[layer], v[layer], q_slots_BxT, k_valid_BxS)
    # Without a cache a query's slot is its own index (or -1): the causal blocks apply.
    return naive(q_BxTxHxDh, k, v, q_slots_BxT, k_valid_BxS, query_block=QUERY_BLOCK)
  if impl == "cudnn":
    return _cudnn(q_BxTxHxDh, k, v, q_slots_BxT, k_valid_BxS)
  if impl == "splash":
    return _splash(q_BxTxHxDh, k, v, q_slots_BxT, k_valid_BxS, block_size)
  if layer is not None:  # decode / prefill into the cache: forward only
    # The cache keeps heads before slots, so a key block is already [B, K, Bk, Dh], the layout
    # the batched dots read: no transposed copy of the cache per layer and token.
    return _flash_forward(
      q_BxTxHxDh, k[layer], v[layer], q_slots_BxT, k_valid_BxS, block_size, kv_axes="bksd"
    )[0]
  return chunked(q_BxTxHxDh, k, v, q_slots_BxT, k_valid_BxS, block_size)


def resolve(
  implementation: str,
  *,
  cached: bool,
  seq_len: int,
  block_size: int = 512,
  backend: str | None = None,
) -> str:
  """The implementation ``attend`` runs for a requested one (``auto`` by ``backend``, default
  the current one; the memory model asks for the platform it plans for)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {implementation!r}; allowed: {IMPLEMENTATIONS}")
  if implementation in ("cudnn", "splash") and cached:
    # The fused kernels take a causal-by-position mask; cache slots need the general rule.
    return "chunked"
  if implementation != "auto":
    return implementation
  backend = backend or jax.default_backend()
  if not cached and seq_len % 128 == 0:
    if backend == "tpu":
      return "splash"
    if backend in ("gpu", "cuda", "rocm"):
      return "cudnn"
  if backend == "cpu" and not cached and seq_len <= block_size:
    return "naive"
  return "chunked"


# ----------------------------------------------------------------------------------------------
# Naive


def visibility(q_slots_BxT: jax.Array, k_valid_BxS: jax.Array) -> jax.Array:
  """[B, T, S] bool: key slot s is visible to a query iff s <= its slot and s is valid."""
  s = k_valid_BxS.shape[1]
  key_slots_1x1xS = jnp.arange(s, dtype=jnp.int32)[None, None, :]
  return (key_slots_1x1xS <= q_slots_BxT[:, :, None]) & k_valid_BxS[:, None, :]


# Query rows per static causal block of the uncached naive path (see ``causal_blocks``), and at
# most this many blocks (they are unrolled: a long explicit-naive sequence must not multiply the
# program). Measured on XLA:CPU (one 30M layer, B 32, T 288, f32, against one block): forward
# 0.119 -> 0.098 / 0.080 / 0.075 / 0.077 s and forward + backward 0.26 -> 0.22 / 0.18 / 0.17 /
# 0.17 s with 2 / 3 / 4 / 6 blocks; flat from 4 to 8 blocks, slower again at 12.
QUERY_BLOCK = 64
MAX_QUERY_BLOCKS = 8


def causal_blocks(t: int, query_block: int) -> list[tuple[int, int]]:
  """Static query blocks [start, end) of a T-row causal attention, sized evenly with at most
  ``query_block`` rows each, or ``MAX_QUERY_BLOCKS`` even blocks where that would take more (one
  block when ``query_block`` is 0 or >= T). Block i only needs keys [0, end): a query sees no
  key past its own slot."""
  n = min(-(-t // query_block), MAX_QUERY_BLOCKS) if query_block else 1
  bounds = [round(t * i / n) for i in range(n + 1)]
  return list(itertools.pairwise(bounds))


def causal_score_fraction(t: int, query_block: int) -> float:
  """The share of the [T, T] scores the causal blocks compute (1.0 for one block)."""
  return sum((end - start) * end for start, end in causal_blocks(t, query_block)) / (t * t)


def naive(
  q_BxTxHxDh: jax.Array,
  k_BxSxKxDh: jax.Array,
  v_BxSxKxDh: jax.Array,
  q_slots_BxT: jax.Array,
  k_valid_BxS: jax.Array,
  query_block: int = 0,
) -> jax.Array:
  """Softmax attention over the full score matrix; query head h reads kv head h // (H / K).

  ``query_block`` > 0 splits the queries into static causal blocks (``causal_blocks``), each
  against only the keys up to its last row; this is exact only where every query's slot is its
  own index or -1 (attention without a cache), which is where ``attend`` uses it."""
  k_BxKxSxDh, v_BxKxSxDh = jnp.swapaxes(k_BxSxKxDh, 1, 2), jnp.swapaxes(v_BxSxKxDh, 1, 2)
  return _naive_head_major(
    q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_slots_BxT, k_valid_BxS, query_block
  )


@jax.custom_jvp
def softmax(x: jax.Array) -> jax.Array:
  """Softmax over the last axis whose derivative reads only its output: y * (dx - sum(y * dx)).

  ``jax.nn.softmax`` gets this rule only under the global ``jax_softmax_custom_jvp`` flag (off by
  default in jax 0.10); differentiated through, its backward pass reads the exponentials and
  their row sums, and XLA:CPU holds more score-sized buffers at once. The 31M Qwen2 update of
  32 x 288 tokens (f32, XLA:CPU) compiles to 3.8 GiB of temp memory with this rule against
  4.5 GiB (16 x 288: 1.9 against 2.3 GiB; 8 x 288: the same); see
  ``tests/model/transformer_test.py::test_attention_softmax_backward_holds_less_memory``.
  Masked scores are finite (``_MASKED``), so no row is inf - inf."""
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


@softmax.defjvp
def _softmax_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  y = softmax(x)
  return y, y * (dx - jnp.sum(y * dx, axis=-1, keepdims=True))


def _naive_head_major(
  q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_slots_BxT, k_valid_BxS, query_block: int = 0
):
  """``naive`` with keys and values head-major. Both products are plain batched matmuls over
  (B, K) with the G query heads of a KV head stacked along the rows ([G*T, Dh] @ [Dh, S]), so
  the scores come out in the layout the softmax reads and no [T, S]-sized operand is transposed.
  Measured on XLA:CPU (one 30M layer, B 32, T 288, f32): forward 0.17 -> 0.12 s, forward and
  backward 0.26 -> 0.24 s against the [B, T, K, G, Dh] x [B, S, K, Dh] einsum this replaces."""
  b, t, h, dh = q_BxTxHxDh.shape
  kh, s = k_BxKxSxDh.shape[1], k_BxKxSxDh.shape[2]
  g = h // kh
  if query_block and s != t:
    raise ValueError(
      f"causal query blocks need keys aligned with the queries (S == T), got {s} != {t}"
    )
  q_BxKxGxTxDh = jnp.transpose(q_BxTxHxDh.reshape(b, t, kh, g, dh), (0, 2, 3, 1, 4))
  blocks = causal_blocks(t, query_block)
  outs, sees = [], []
  for start, end in blocks:
    m, keys = end - start, s if len(blocks) == 1 else end
    q_BxKxMxDh = q_BxKxGxTxDh[:, :, :, start:end].reshape(b, kh, g * m, dh)
    scores_BxKxMxS = jnp.einsum(
      "bkmd,bksd->bkms", q_BxKxMxDh, k_BxKxSxDh[:, :, :keys], preferred_element_type=jnp.float32
    )
    scores_BxKxGxMxS = scores_BxKxMxS.reshape(b, kh, g, m, keys) * (1.0 / math.sqrt(dh))
    allowed_BxMxS = visibility(q_slots_BxT[:, start:end], k_valid_BxS[:, :keys])
    scores_BxKxGxMxS = jnp.where(allowed_BxMxS[:, None, None], scores_BxKxGxMxS, _MASKED)
    probs_BxKxGxMxS = softmax(scores_BxKxGxMxS).astype(v_BxKxSxDh.dtype)
    probs_BxKxMxS = probs_BxKxGxMxS.reshape(b, kh, g * m, keys)
    out_BxKxMxDh = jnp.einsum("bkms,bksd->bkmd", probs_BxKxMxS, v_BxKxSxDh[:, :, :keys])
    outs.append(out_BxKxMxDh.reshape(b, kh, g, m, dh))
    sees.append(jnp.any(allowed_BxMxS, axis=-1))
  out_BxKxGxTxDh = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
  out_BxTxHxDh = jnp.transpose(out_BxKxGxTxDh, (0, 3, 1, 2, 4)).reshape(b, t, h, dh)
  sees_any_BxT = sees[0] if len(sees) == 1 else jnp.concatenate(sees, axis=1)
  return jnp.where(sees_any_BxT[:, :, None, None], out_BxTxHxDh, 0).astype(q_BxTxHxDh.dtype)


# ----------------------------------------------------------------------------------------------
# Chunked (blockwise online softmax with a custom backward pass)


def _split(n: int, block: int) -> tuple[int, int]:
  """(size, count) of the fewest blocks of at most ``block`` covering ``n``, sized evenly: 576
  with block 512 is two blocks of 288, not 512 + 64 padded to 1024 (which did ~3x the work of
  576 in both passes)."""
  count = -(-n // block)
  return -(-n // count), count


def _q_blocks(
  q_BxTxHxDh: jax.Array, q_slots_BxT: jax.Array, num_kv_heads: int, block: int
) -> tuple[jax.Array, jax.Array, int]:
  """Queries as [Nq, B, Bq, K, G, Dh] blocks (T padded with slot -1) and their slots [Nq, B, Bq]."""
  b, t, h, dh = q_BxTxHxDh.shape
  bq, nq = _split(t, block)
  pad = nq * bq - t
  q = jnp.pad(q_BxTxHxDh, ((0, 0), (0, pad), (0, 0), (0, 0)))
  slots = jnp.pad(q_slots_BxT, ((0, 0), (0, pad)), constant_values=-1)
  q_NxBxQxKxGxDh = jnp.moveaxis(q.reshape(b, nq, bq, num_kv_heads, h // num_kv_heads, dh), 1, 0)
  return q_NxBxQxKxGxDh, jnp.moveaxis(slots.reshape(b, nq, bq), 1, 0), bq


def _key_block(k, v, k_valid_BxS, j: jax.Array, bk: int, kv_axes: str = "bskd"):
  """Key block ``j``: (nominal start, read start, keys, values, validity), keys and values in
  ``kv_axes`` order ("bskd": [B, Bk, K, Dh]; "bksd", the KV cache's: [B, K, Bk, Dh]).

  The read start is clamped so the last block ends at S; its keys before the nominal start
  belong to the previous block and are masked in ``_block_scores``.
  """
  axis = kv_axes.index("s")
  s = k.shape[axis]
  nominal = j * bk
  start = jnp.minimum(nominal, s - bk)
  k_blk = jax.lax.dynamic_slice_in_dim(k, start, bk, axis=axis)
  v_blk = jax.lax.dynamic_slice_in_dim(v, start, bk, axis=axis)
  valid = jax.lax.dynamic_slice_in_dim(k_valid_BxS, start, bk, axis=1)
  return nominal, start, k_blk, v_blk, valid


def _block_scores(
  q_BxQxKxGxDh, k_blk, slots_BxQ, valid_BxKb, start, nominal, kv_axes: str = "bskd"
) -> tuple[jax.Array, jax.Array]:
  """Scaled scores [B, K, G, Bq, Bk] (masked entries _MASKED) and the visibility [B, 1, 1, Bq, Bk].

  ``start`` is where the block was read, ``nominal`` where it should begin: keys before
  ``nominal`` belong to the previous block (the last block is clamped to end at S) and are masked.
  """
  bk = valid_BxKb.shape[1]
  dh = q_BxQxKxGxDh.shape[-1]
  key_slots_K = start + jnp.arange(bk, dtype=jnp.int32)
  allowed_BxQxK = (
    (key_slots_K[None, None, :] <= slots_BxQ[:, :, None])
    & valid_BxKb[:, None, :]
    & (key_slots_K >= nominal)[None, None, :]
  )
  scores = jnp.einsum(
    f"bqkgd,{kv_axes}->bkgqs", q_BxQxKxGxDh, k_blk, preferred_element_type=jnp.float32
  ) * (1.0 / math.sqrt(dh))
  allowed = allowed_BxQxK[:, None, None]
  return jnp.where(allowed, scores, _MASKED), allowed


def _num_kv_blocks(slots_NxBxQ: jax.Array, bk: int, nk: int) -> jax.Array:
  """Per query block, how many key blocks hold a visible slot: ceil((max slot + 1) / Bk)."""
  hi_N = jnp.max(slots_NxBxQ, axis=(1, 2))
  return jnp.clip((hi_N + bk) // bk, 0, nk).astype(jnp.int32)


def _flash_forward(q_BxTxHxDh, k, v, q_slots_BxT, k_valid_BxS, block, kv_axes: str = "bskd"):
  """Output [B, T, H, Dh] and the log-sum-exp [Nq, B, K, G, Bq] (0 where nothing is visible).

  ``k``/``v`` are in ``kv_axes`` order: "bskd" [B, S, K, Dh], or the KV cache's "bksd".
  """
  b, t, h, dh = q_BxTxHxDh.shape
  s, num_kv = k_valid_BxS.shape[1], k.shape[kv_axes.index("k")]
  q_N, slots_N, bq = _q_blocks(q_BxTxHxDh, q_slots_BxT, num_kv, block)
  bk, nk = _split(s, block)
  counts_N = _num_kv_blocks(slots_N, bk, nk)

  def one_q_block(args):
    q_BxQxKxGxDh, slots_BxQ, count = args
    bb, _, kk, gg, _ = q_BxQxKxGxDh.shape
    stats = (bb, kk, gg, bq)

    def kv_step(j, carry):
      m, l, acc = carry
      nominal, start, k_blk, v_blk, valid = _key_block(k, v, k_valid_BxS, j, bk, kv_axes)
      scores, allowed = _block_scores(
        q_BxQxKxGxDh, k_blk, slots_BxQ, valid, start, nominal, kv_axes
      )
      m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
      p = jnp.exp(scores - m_new[..., None]) * allowed
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum(
        f"bkgqs,{kv_axes}->bkgqd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32
      )
      return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

    init = (
      jnp.full(stats, _MASKED, jnp.float32),
      jnp.zeros(stats, jnp.float32),
      jnp.zeros((*stats, dh), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, count, kv_step, init)
    seen = l > 0
    out_BxKxGxQxDh = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out_BxKxGxQxDh, lse

  out_NxBxKxGxQxDh, lse_N = jax.lax.map(one_q_block, (q_N, slots_N, counts_N))
  out = jnp.transpose(out_NxBxKxGxQxDh, (1, 0, 4, 2, 3, 5)).reshape(b, -1, h, dh)[:, :t]
  return out.astype(q_BxTxHxDh.dtype), lse_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def chunked(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, q_slots_BxT, k_valid_BxS, block_size=512):
  """Blockwise attention without a cache; differentiable with O(T) memory (custom backward)."""
  return _flash_forward(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, q_slots_BxT, k_valid_BxS, block_size)[0]


def _chunked_fwd(q, k, v, q_slots, k_valid, block_size):
  out, lse = _flash_forward(q, k, v, q_slots, k_valid, block_size)
  return out, (q, k, v, q_slots, k_valid, out, lse)


def _chunked_bwd(block_size, residuals, d_out_BxTxHxDh):
  """FlashAttention-2 backward: key blocks outer, query blocks inner (skipped when invisible)."""
  q, k, v, q_slots, k_valid, out, lse_N = residuals
  b, t, h, dh = q.shape
  s, num_kv = k.shape[1], k.shape[2]
  q_N, slots_N, bq = _q_blocks(q, q_slots, num_kv, block_size)
  do_N = _q_blocks(d_out_BxTxHxDh.astype(jnp.float32), q_slots, num_kv, block_size)[0]
  # rowsum(dO * O), reduced on the [B, T, H, Dh] arrays before blocking: reduced on the 6-D
  # blocks (einsum or sum alike) XLA's CPU backend took ~35x longer, ~0.1 s per layer at 30M.
  delta_BxTxH = jnp.sum(d_out_BxTxHxDh.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta_N = jnp.moveaxis(
    _q_blocks(delta_BxTxH[..., None], q_slots, num_kv, block_size)[0][..., 0], 2, -1
  )
  hi_N = jnp.max(slots_N, axis=(1, 2))
  nq = q_N.shape[0]
  bk, nk = _split(s, block_size)
  scale = 1.0 / math.sqrt(dh)

  def kv_block(j, carry):
    dq_N, dk, dv = carry
    nominal, start, k_blk, v_blk, valid = _key_block(k, v, k_valid, j, bk)

    def q_block(i, inner):
      dq_N, dk_blk, dv_blk = inner
      scores, allowed = _block_scores(q_N[i], k_blk, slots_N[i], valid, start, nominal)
      p = jnp.exp(scores - lse_N[i][..., None]) * allowed
      dv_blk = dv_blk + jnp.einsum("bkgqs,bqkgd->bskd", p, do_N[i])
      dp = jnp.einsum("bqkgd,bskd->bkgqs", do_N[i], v_blk, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_N[i][..., None]) * scale
      dq_N = dq_N.at[i].add(jnp.einsum("bkgqs,bskd->bqkgd", ds, k_blk.astype(jnp.float32)))
      dk_blk = dk_blk + jnp.einsum("bkgqs,bqkgd->bskd", ds, q_N[i].astype(jnp.float32))
      return dq_N, dk_blk, dv_blk

    def maybe(i, inner):
      return jax.lax.cond(hi_N[i] >= nominal, q_block, lambda _, x: x, i, inner)

    zeros = jnp.zeros((b, bk, num_kv, dh), jnp.float32)
    dq_N, dk_blk, dv_blk = jax.lax.fori_loop(0, nq, maybe, (dq_N, zeros, zeros))
    dk = jax.lax.dynamic_update_slice(
      dk, jax.lax.dynamic_slice(dk, (0, start, 0, 0), dk_blk.shape) + dk_blk, (0, start, 0, 0)
    )
    dv = jax.lax.dynamic_update_slice(
      dv, jax.lax.dynamic_slice(dv, (0, start, 0, 0), dv_blk.shape) + dv_blk, (0, start, 0, 0)
    )
    return dq_N, dk, dv

  init = (
    jnp.zeros(q_N.shape, jnp.float32),
    jnp.zeros(k.shape, jnp.float32),
    jnp.zeros(v.shape, jnp.float32),
  )
  dq_N, dk, dv = jax.lax.fori_loop(0, nk, kv_block, init)
  dq = jnp.moveaxis(dq_N, 0, 1).reshape(b, nq * bq, h, dh)[:, :t]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ----------------------------------------------------------------------------------------------
# Fused kernels (no cache): cuDNN flash on GPU, Pallas splash on TPU


def _packed_lengths(q_slots_BxT: jax.Array, k_valid_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
  return (
    jnp.sum(q_slots_BxT >= 0, axis=1, dtype=jnp.int32),
    jnp.sum(k_valid_BxS, axis=1, dtype=jnp.int32),
  )


def _cudnn(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, q_slots_BxT, k_valid_BxS) -> jax.Array:
  """cuDNN flash attention: causal, each row's first ``length`` tokens real (packed rows)."""
  q_len_B, kv_len_B = _packed_lengths(q_slots_BxT, k_valid_BxS)
  out = jax.nn.dot_product_attention(
    q_BxTxHxDh,
    k_BxSxKxDh.astype(q_BxTxHxDh.dtype),
    v_BxSxKxDh.astype(q_BxTxHxDh.dtype),
    is_causal=True,
    query_seq_lengths=q_len_B,
    key_value_seq_lengths=kv_len_B,
    implementation="cudnn",
  )
  return jnp.where((q_slots_BxT >= 0)[:, :, None, None], out, 0).astype(q_BxTxHxDh.dtype)


def _splash(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, q_slots_BxT, k_valid_BxS, block) -> jax.Array:
  """Pallas splash attention (TPU): causal mask, padding as segment 0 (real tokens segment 1)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  b, t, h, dh = q_BxTxHxDh.shape
  s, num_kv = k_BxSxKxDh.shape[1], k_BxSxKxDh.shape[2]
  g = h // num_kv
  bs = min(block, t, s)
  sizes = sk.BlockSizes(
    block_q=bs,
    block_kv=bs,
    block_kv_compute=bs,
    block_q_dkv=bs,
    block_kv_dkv=bs,
    block_kv_dkv_compute=bs,
    block_q_dq=bs,
    block_kv_dq=bs,
  )
  mask = sm.MultiHeadMask([sm.CausalMask((t, s)) for _ in range(g)])
  kernel = sk.make_splash_mqa_single_device(
    mask, block_sizes=sizes, interpret=jax.default_backend() != "tpu"
  )
  q_BxKxGxTxDh = jnp.transpose(q_BxTxHxDh.reshape(b, t, num_kv, g, dh), (0, 2, 3, 1, 4)) * (
    1.0 / math.sqrt(dh)
  )
  k_BxKxSxDh = jnp.transpose(k_BxSxKxDh, (0, 2, 1, 3)).astype(q_BxTxHxDh.dtype)
  v_BxKxSxDh = jnp.transpose(v_BxSxKxDh, (0, 2, 1, 3)).astype(q_BxTxHxDh.dtype)
  segments = sk.SegmentIds(q=(q_slots_BxT >= 0).astype(jnp.int32), kv=k_valid_BxS.astype(jnp.int32))
  per_kv_head = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over K
  per_row = jax.vmap(per_kv_head, in_axes=(0, 0, 0, 0))  # over B
  out_BxKxGxTxDh = per_row(q_BxKxGxTxDh, k_BxKxSxDh, v_BxKxSxDh, segments)
  out = jnp.transpose(out_BxKxGxTxDh, (0, 3, 1, 2, 4)).reshape(b, t, h, dh)
  return jnp.where((q_slots_BxT >= 0)[:, :, None, None], out, 0).astype(q_BxTxHxDh.dtype)
