"""Decoding with the KV cache reproduces the full causal forward, for any padding and fill level."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.model import (
  CACHE_KV_AXES,
  KVCache,
  cache_partition_specs,
  decode_step,
  init_cache,
  logits,
  prefill,
)
from earl_jax.model.config import ModelConfig
from earl_jax.model.transformer import Decoder
from earl_jax.types import BATCH, CACHE_SEQ, HEAD_DIM, KV_HEADS, LAYERS

_CFG = ModelConfig(
  vocab_size=61, embed_dim=40, mlp_dim=56, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=10
)
_LENGTHS = (5, 2, 7)  # prompt lengths of the three rows
_GEN = 4  # tokens fed one at a time after the prompt
_P = max(_LENGTHS)


@pytest.fixture(scope="module")
def model() -> Decoder:
  """A tiny decoder with O(1) random weights, so every token visibly changes the logits."""
  model = Decoder(_CFG, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  for _, var in nnx.to_flat_state(nnx.state(model)):
    shape = var.get_value().shape
    var.set_value(jnp.asarray(rng.normal(0.0, 0.4, shape), jnp.float32))
  return model


@pytest.fixture(scope="module")
def sequences(model) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Per row: its real tokens (prompt + generated) and the unpadded full-forward logits."""
  rng = np.random.default_rng(2)
  seqs = [rng.integers(0, _CFG.vocab_size, n + _GEN).astype(np.int32) for n in _LENGTHS]
  full = jax.jit(logits)
  return seqs, [np.asarray(full(model, s[None]))[0] for s in seqs]


def _padded_prompt(seqs, left: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  b = len(seqs)
  tokens, mask, pos = np.zeros((b, _P), np.int32), np.zeros((b, _P), bool), np.zeros((b, _P))
  for i, (s, n) in enumerate(zip(seqs, _LENGTHS)):
    cols = slice(_P - n, _P) if left else slice(0, n)
    tokens[i, cols], mask[i, cols], pos[i, cols] = s[:n], True, np.arange(n)
  return tokens, mask, pos.astype(np.int32)


@pytest.mark.parametrize("left", [True, False], ids=["left_padded", "right_padded"])
def test_prefill_then_decode_matches_full_forward(model, sequences, left):
  seqs, full = sequences
  tokens, mask, pos = _padded_prompt(seqs, left)
  cache = init_cache(_CFG, len(seqs), _P + _GEN)
  out, cache = jax.jit(prefill)(model, cache, tokens, pos, mask)
  for i, n in enumerate(_LENGTHS):
    np.testing.assert_allclose(out[i, mask[i], : _CFG.vocab_size], full[i][:n], atol=1e-5, rtol=0)
  step = jax.jit(decode_step, donate_argnums=(1,))
  for g in range(_GEN):
    token_B = np.array([s[n + g] for s, n in zip(seqs, _LENGTHS)], np.int32)
    pos_B = np.array([n + g for n in _LENGTHS], np.int32)
    out_BxV, cache = step(model, cache, token_B, pos_B, np.ones(len(seqs), bool))
    for i, n in enumerate(_LENGTHS):
      np.testing.assert_allclose(out_BxV[i, : _CFG.vocab_size], full[i][n + g], atol=1e-5, rtol=0)
  # Padding takes no slot: each row holds exactly its tokens, compactly.
  np.testing.assert_array_equal(cache.end_B, np.array(_LENGTHS) + _GEN)
  np.testing.assert_array_equal(cache.valid_BxS.sum(axis=1), np.array(_LENGTHS) + _GEN)


def _concat_rows(caches: list[KVCache]) -> KVCache:
  return KVCache(
    k=jnp.concatenate([c.k for c in caches], axis=1),
    v=jnp.concatenate([c.v for c in caches], axis=1),
    valid_BxS=jnp.concatenate([c.valid_BxS for c in caches], axis=0),
    end_B=jnp.concatenate([c.end_B for c in caches], axis=0),
  )


def test_chunked_continuation_rows_with_different_end(model, sequences):
  """Rows prefilled separately (end_B = 5, 2, 7) get a padded 4-wide chunk appended at once."""
  seqs, full = sequences
  caches, jit_prefill = [], jax.jit(prefill)
  for s, n in zip(seqs, _LENGTHS):
    cache = init_cache(_CFG, 1, _P + _GEN + 2)
    _, cache = jit_prefill(model, cache, s[None, :n], np.arange(n)[None], np.ones((1, n), bool))
    caches.append(cache)
  cache = _concat_rows(caches)
  np.testing.assert_array_equal(cache.end_B, _LENGTHS)
  # Chunk of width _GEN + 1: row 0 left-padded, row 1 right-padded, row 2 padded in the middle.
  w = _GEN + 1
  layouts = [[False, True, True, True, True], [True, True, True, True, False]]
  layouts.append([True, True, False, True, True])
  tokens, mask, pos = np.zeros((3, w), np.int32), np.array(layouts), np.zeros((3, w), np.int32)
  for i, (s, n) in enumerate(zip(seqs, _LENGTHS)):
    tokens[i, mask[i]], pos[i, mask[i]] = s[n : n + _GEN], np.arange(n, n + _GEN)
  out, cache = jax.jit(prefill)(model, cache, tokens, pos, mask)
  for i, n in enumerate(_LENGTHS):
    np.testing.assert_allclose(
      out[i, mask[i], : _CFG.vocab_size], full[i][n : n + _GEN], atol=1e-5, rtol=0
    )
  # Only the valid tokens take slots, in order: every row stays compact.
  np.testing.assert_array_equal(cache.end_B, np.array(_LENGTHS) + _GEN)
  for i, n in enumerate(_LENGTHS):
    np.testing.assert_array_equal(cache.valid_BxS[i], np.arange(cache.max_len) < n + _GEN)


def test_padded_full_forward_matches_unpadded(model, sequences):
  """Without a cache, padding tokens (mask False) are invisible to the real ones."""
  seqs, full = sequences
  tokens, mask, pos = _padded_prompt(seqs, left=True)
  out, cache = jax.jit(lambda m, t, p, k: m(t, p, mask_BxT=k))(model, tokens, pos, mask)
  assert cache is None
  for i, n in enumerate(_LENGTHS):
    np.testing.assert_allclose(out[i, mask[i], : _CFG.vocab_size], full[i][:n], atol=1e-5, rtol=0)
  assert np.all(np.isfinite(out))  # padding queries see no key: uniform softmax, not NaN


def test_init_cache_layout_and_overflow_is_dropped():
  cache = init_cache(_CFG, 2, 3, dtype="bfloat16")
  assert cache.k.shape == cache.v.shape == (2, 2, 2, 3, 10) and cache.k.dtype == jnp.bfloat16
  assert cache.valid_BxS.dtype == jnp.bool_ and cache.end_B.dtype == jnp.int32
  assert CACHE_KV_AXES == (LAYERS, BATCH, KV_HEADS, CACHE_SEQ, HEAD_DIM)
  specs = cache_partition_specs()
  assert tuple(specs.k) == CACHE_KV_AXES and tuple(specs.valid_BxS) == (BATCH, CACHE_SEQ)
  assert jax.tree.structure(specs) == jax.tree.structure(cache)
  model = Decoder(_CFG, rngs=nnx.Rngs(0))
  tokens = np.ones((2, 4), np.int32)
  args = (tokens, np.zeros((2, 4), np.int32), np.ones((2, 4), bool))
  _, cache = jax.jit(prefill)(model, cache, *args)
  assert cache.valid_BxS.tolist() == [[True] * 3] * 2  # the 4th token had no slot
  np.testing.assert_array_equal(cache.end_B, 4)
  assert float(jnp.abs(cache.k.astype(jnp.float32)).sum()) > 0


def test_init_cache_rejects_empty():
  with pytest.raises(ValueError, match="max_len >= 1"):
    init_cache(_CFG, 2, 0)
