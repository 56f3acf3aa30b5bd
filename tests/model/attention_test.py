"""Every attention implementation against the naive one: forward and gradients, padding, GQA,
multi-turn cache slots; and the chunked kernel's memory grows linearly in T."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.model import attention

_B, _H, _K, _DH = 3, 4, 2, 8


def _inputs(t: int, s: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(_B, t, _H, _DH)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(_B, s, _K, _DH)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(_B, s, _K, _DH)), jnp.float32)
  return q, k, v


def _packed(t: int, lengths: tuple[int, ...], left: tuple[int, ...] = (0, 0, 0)):
  """No-cache slots: row b has padding at [0, left) and after left + length."""
  mask = np.zeros((_B, t), bool)
  for b, (n, l0) in enumerate(zip(lengths, left)):
    mask[b, l0 : l0 + n] = True
  slots = np.where(mask, np.arange(t)[None], -1).astype(np.int32)
  return jnp.asarray(slots), jnp.asarray(mask)


@pytest.mark.parametrize(
  "t,block,lengths,left",
  [
    (16, 16, (16, 16, 16), (0, 0, 0)),  # one block
    (40, 16, (40, 23, 1), (0, 0, 0)),  # right padding, T not a multiple of the block
    (40, 8, (30, 17, 5), (10, 3, 0)),  # left padding: early query blocks see nothing
    (33, 7, (33, 20, 0), (0, 13, 0)),  # an all-padding row; odd block
  ],
)
def test_chunked_matches_naive_forward_and_gradients(t, block, lengths, left):
  # Blocks are sized evenly (40 with block 16: three of 14, the last key block read from 26 with
  # its first two keys masked), so these cover uneven splits and the clamped last key block.
  q, k, v = _inputs(t, t, seed=t + block)
  slots, valid = _packed(t, lengths, left)
  cot = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, slots, valid) * cot * valid[:, :, None, None])

  naive = lambda *a: attention.naive(*a)  # noqa: E731
  chunked = lambda q, k, v, s, m: attention.chunked(q, k, v, s, m, block)  # noqa: E731
  out_n, out_c = jax.jit(naive)(q, k, v, slots, valid), jax.jit(chunked)(q, k, v, slots, valid)
  np.testing.assert_allclose(np.asarray(out_c), np.asarray(out_n), atol=1e-5, rtol=0)
  assert np.all(np.asarray(out_c)[~np.asarray(valid)] == 0)  # padding queries output 0
  g_n = jax.jit(jax.grad(lambda *a: loss(naive, *a), argnums=(0, 1, 2)))(q, k, v)
  g_c = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(g_c, g_n):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_causal_blocks_cover_the_queries():
  assert attention.causal_blocks(288, 64) == [
    (0, 58),
    (58, 115),
    (115, 173),
    (173, 230),
    (230, 288),
  ]
  assert attention.causal_blocks(40, 0) == attention.causal_blocks(40, 64) == [(0, 40)]
  assert attention.causal_score_fraction(40, 64) == 1.0
  # A long sequence is cut into at most MAX_QUERY_BLOCKS blocks (they are unrolled).
  long = attention.causal_blocks(32768, 64)
  assert len(long) == attention.MAX_QUERY_BLOCKS and long[-1] == (28672, 32768)
  # n even blocks of a T x T causal product compute (n + 1) / (2n) of the scores.
  assert attention.causal_score_fraction(256, 64) == pytest.approx(5 / 8)
  q, k, v = _inputs(8, 12)  # keys not aligned with the queries (a cache): no causal blocks
  slots, valid = _packed(12, (12, 12, 12))
  with pytest.raises(ValueError, match="S == T"):
    attention.naive(q, k, v, slots[:, :8], valid, query_block=4)


@pytest.mark.parametrize(
  "t,query_block,lengths,left",
  [
    (40, 16, (40, 23, 1), (0, 0, 0)),  # right padding, T not a multiple of the block
    (40, 8, (30, 17, 5), (10, 3, 0)),  # left padding: the first blocks of a row see nothing
    (33, 7, (33, 20, 0), (0, 13, 0)),  # an all-padding row; odd block
  ],
)
def test_causal_query_blocks_match_naive_forward_and_gradients(t, query_block, lengths, left):
  """Naive attention in static causal query blocks (what ``attend`` runs without a cache) equals
  one block."""
  q, k, v = _inputs(t, t, seed=t + query_block)
  slots, valid = _packed(t, lengths, left)
  cot = jnp.asarray(np.random.default_rng(5).normal(size=q.shape), jnp.float32)
  whole = lambda q, k, v: attention.naive(q, k, v, slots, valid)  # noqa: E731
  blocked = lambda q, k, v: attention.naive(q, k, v, slots, valid, query_block)  # noqa: E731
  out_w, out_b = jax.jit(whole)(q, k, v), jax.jit(blocked)(q, k, v)
  np.testing.assert_allclose(np.asarray(out_b), np.asarray(out_w), atol=1e-5, rtol=0)
  assert np.all(np.asarray(out_b)[~np.asarray(valid)] == 0)

  def loss(fn):
    return jax.grad(lambda *a: jnp.sum(fn(*a) * cot * valid[:, :, None, None]), argnums=(0, 1, 2))

  for a, b in zip(jax.jit(loss(blocked))(q, k, v), jax.jit(loss(whole))(q, k, v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_cache_slots_multi_turn_match_naive():
  """A prefill chunk into a partly filled cache: rows at different fill levels, stacked layers."""
  t, s, layers = 5, 37, 3
  q, _, _ = _inputs(t, s, seed=3)
  rng = np.random.default_rng(4)
  # The KV cache's layout: [L, B, K, S, Dh]
  k_cache = jnp.asarray(rng.normal(size=(layers, _B, _K, s, _DH)), jnp.float32)
  v_cache = jnp.asarray(rng.normal(size=(layers, _B, _K, s, _DH)), jnp.float32)
  end = np.array([9, 0, 30])  # filled slots per row before this chunk
  chunk_mask = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
  rank = np.cumsum(chunk_mask, axis=1) - 1
  slots = np.where(chunk_mask, end[:, None] + rank, -1).astype(np.int32)
  valid = np.zeros((_B, s), bool)
  for b in range(_B):
    valid[b, : end[b] + chunk_mask[b].sum()] = True
  valid[0, 3] = False  # an interior padding slot left by an earlier turn
  layer = jnp.int32(1)
  for block in (4, 16, 64):
    got = jax.jit(
      lambda q, k, v, l, block=block: attention.attend(
        q,
        k,
        v,
        jnp.asarray(slots),
        jnp.asarray(valid),
        implementation="chunked",
        block_size=block,
        layer=l,
      )
    )(q, k_cache, v_cache, layer)
    k1, v1 = jnp.swapaxes(k_cache[1], 1, 2), jnp.swapaxes(v_cache[1], 1, 2)  # [B, S, K, Dh]
    want = attention.naive(q, k1, v1, jnp.asarray(slots), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
  naive_cached = attention.attend(
    q, k_cache, v_cache, jnp.asarray(slots), jnp.asarray(valid), implementation="naive", layer=layer
  )
  np.testing.assert_allclose(np.asarray(naive_cached), np.asarray(want), atol=1e-6, rtol=0)


def test_blocks_are_the_fewest_and_even():
  # Past the block size the work is split evenly, never one full block plus a padded sliver.
  assert attention._split(576, 512) == (288, 2)
  assert attention._split(512, 512) == (512, 1)
  assert attention._split(100, 512) == (100, 1)
  assert attention._split(40, 16) == (14, 3)
  assert attention._split(1025, 512) == (342, 3)


def test_decode_skips_unfilled_cache_blocks():
  """One query per row: the key blocks visited follow the longest filled row, not S."""
  s, block = 64, 8
  slots = jnp.asarray([[3], [10], [-1]], jnp.int32)
  counts = attention._num_kv_blocks(slots.reshape(1, _B, 1), block, s // block)
  assert int(counts[0]) == 2  # slots 0..10 live in the first two blocks of eight


def test_bf16_chunked_close_to_naive():
  t = 48
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(t, t, seed=9))
  slots, valid = _packed(t, (48, 30, 12))
  want = attention.naive(q, k, v, slots, valid).astype(jnp.float32)
  got = attention.chunked(q, k, v, slots, valid, 16).astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-2, rtol=0)


def test_resolve_rules():
  assert attention.resolve("auto", cached=True, seq_len=128) == "chunked"
  assert attention.resolve("cudnn", cached=True, seq_len=128) == "chunked"
  assert attention.resolve("naive", cached=False, seq_len=7) == "naive"
  # auto, per backend: the fused kernels where they apply; on CPU naive for one block's worth
  # of keys (the chunked kernel's loops cost more than the scores there), chunked past it.
  auto = lambda backend, t=128, **kw: attention.resolve(  # noqa: E731
    "auto", cached=kw.get("cached", False), seq_len=t, block_size=256, backend=backend
  )
  assert (auto("tpu"), auto("gpu"), auto("gpu", 100)) == ("splash", "cudnn", "chunked")
  assert (auto("cpu"), auto("cpu", 256), auto("cpu", 257)) == ("naive", "naive", "chunked")
  assert auto("cpu", 64, cached=True) == "chunked"  # decoding into the cache: never all scores
  assert attention.resolve("auto", cached=False, seq_len=8) == auto(jax.default_backend(), 8)
  with pytest.raises(ValueError, match="allowed"):
    attention.resolve("flash", cached=False, seq_len=8)


def test_splash_interpret_matches_naive():
  """Pallas splash attention (interpret mode off TPU), packed rows with padding."""
  t = 128
  q, k, v = _inputs(t, t, seed=11)
  slots, valid = _packed(t, (128, 70, 1))
  want = attention.naive(q, k, v, slots, valid)
  got = attention.attend(q, k, v, slots, valid, implementation="splash", block_size=128)
  keep = np.asarray(valid)[:, :, None, None]
  np.testing.assert_allclose(np.asarray(got) * keep, np.asarray(want) * keep, atol=1e-5, rtol=0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
def test_cudnn_matches_naive():
  t = 256
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(t, t, seed=12))
  slots, valid = _packed(t, (256, 100, 3))
  cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.bfloat16)

  def loss(impl, q, k, v):
    out = attention.attend(q, k, v, slots, valid, implementation=impl)
    return jnp.sum((out * cot).astype(jnp.float32) * valid[:, :, None, None])

  for fn in (lambda impl: attention.attend(q, k, v, slots, valid, implementation=impl),):
    np.testing.assert_allclose(
      np.asarray(fn("cudnn"), np.float32), np.asarray(fn("naive"), np.float32), atol=2e-2
    )
  g_c = jax.grad(lambda *a: loss("cudnn", *a), argnums=(0, 1, 2))(q, k, v)
  g_n = jax.grad(lambda *a: loss("naive", *a), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_c, g_n):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=5e-2)


def _compiled_bytes(fn, t: int) -> int:
  q = jax.ShapeDtypeStruct((1, t, _H, _DH), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, _K, _DH), jnp.float32)
  slots = jax.ShapeDtypeStruct((1, t), jnp.int32)
  valid = jax.ShapeDtypeStruct((1, t), jnp.bool_)
  m = jax.jit(fn).lower(q, kv, kv, slots, valid).compile().memory_analysis()
  return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def test_chunked_gradient_memory_is_linear_in_t():
  """Compiled peak of forward + backward: doubling T doubles chunked memory, quadruples naive's."""

  def grad_of(fn):
    return jax.grad(lambda q, k, v, s, m: jnp.sum(fn(q, k, v, s, m)), argnums=(0, 1, 2))

  chunked = grad_of(lambda q, k, v, s, m: attention.chunked(q, k, v, s, m, 128))
  naive = grad_of(attention.naive)
  c1, c2 = _compiled_bytes(chunked, 1024), _compiled_bytes(chunked, 2048)
  n1, n2 = _compiled_bytes(naive, 1024), _compiled_bytes(naive, 2048)
  assert c2 / c1 < 2.3, (c1, c2)
  assert n2 / n1 > 3.0, (n1, n2)
  assert c2 < n2 / 10


def test_softmax_matches_jax_nn_softmax_to_second_order():
  """``attention.softmax`` (its own derivative rule) gives jax.nn.softmax's values and first and
  second derivatives, masked entries included. Its memory effect is tested on the decoder
  (transformer_test.py::test_attention_softmax_backward_holds_less_memory)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 9)).astype(np.float32)
  x = jnp.asarray(np.where(rng.random(x.shape) < 0.3, attention._MASKED, x))
  x = x.at[:, :, 0].set(1.0)  # every row sees something
  theirs = lambda x: jax.nn.softmax(x, axis=-1)  # noqa: E731
  np.testing.assert_allclose(attention.softmax(x), theirs(x), rtol=1e-6, atol=1e-7)
  weights = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

  def first(f):
    return jax.grad(lambda x: jnp.sum(jnp.sin(f(x)) * weights))

  def second(f):
    return jax.grad(lambda x: jnp.sum(first(f)(x) ** 2))

  for derivative in (first, second):
    np.testing.assert_allclose(
      derivative(attention.softmax)(x), derivative(theirs)(x), rtol=1e-4, atol=1e-5
    )
