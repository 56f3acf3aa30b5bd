"""The rollout engine against the full forward: greedy = argmax, log-probs = reference scores."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.rl import reference
from earl_jax.sampler import engine, sampling

CFG = ModelConfig(
  vocab_size=53, embed_dim=40, mlp_dim=72, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=10,
  vocab_multiple=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
  return model_lib.Decoder(CFG, rngs=nnx.Rngs(0))


def _right_padded(rows: list[list[int]], width: int):
  b = len(rows)
  tokens = np.zeros((b, width), np.int32)
  mask = np.zeros((b, width), bool)
  for i, r in enumerate(rows):
    tokens[i, : len(r)], mask[i, : len(r)] = r, True
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), (b, width)) * mask
  return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(positions.astype(np.int32))


def _run(model, spec, rows, width=8, cache_len=64, seed=0, active=None, cache=None):
  graphdef, state = nnx.split(model)
  fn = engine.make_generate_fn(graphdef, spec)
  cache = model_lib.init_cache(CFG, len(rows), cache_len) if cache is None else cache
  tokens, mask, positions = _right_padded(rows, width)
  active = jnp.ones(len(rows), bool) if active is None else jnp.asarray(active)
  return fn(state, cache, tokens, mask, positions, active, jax.random.key(seed))


def test_greedy_equals_argmax_of_the_full_forward_step_by_step(model):
  rows = [[3, 5, 7, 11, 13], [2, 4], [17, 19, 23]]
  out, _ = _run(model, engine.GenerationSpec(max_new_tokens=6), rows)
  assert np.asarray(out.mask_BxN).all()  # no stop sequences: every row runs all 6 steps
  for i, prompt in enumerate(rows):
    seq = list(prompt) + [int(t) for t in out.tokens_BxN[i]]
    full = np.asarray(model_lib.logits(model, jnp.asarray([seq])))[0]
    for j in range(6):
      assert int(out.tokens_BxN[i, j]) == int(np.argmax(full[len(prompt) - 1 + j]))


def test_sampled_logps_equal_reference_scores_at_temperature_one(model):
  rows = [[3, 5, 7, 11, 13], [2, 4], [17, 19, 23, 29, 31, 37, 41]]
  spec = engine.GenerationSpec(strategy=sampling.Temperature(1.0), max_new_tokens=7)
  out, _ = _run(model, spec, rows, seed=3)
  seqs = [list(r) + [int(t) for t in out.tokens_BxN[i]] for i, r in enumerate(rows)]
  tokens, valid, positions = _right_padded(seqs, 16)
  scored, _ = reference.token_logps(model, tokens, positions, valid, chunk_size=4)
  for i, r in enumerate(rows):
    np.testing.assert_allclose(
      np.asarray(out.logps_BxN[i]), np.asarray(scored[i, len(r) : len(r) + 7]), atol=2e-5
    )


def test_stop_rows_end_and_are_masked(model):
  rows = [[3, 5, 7], [2, 4, 6, 8], [9]]
  free, _ = _run(model, engine.GenerationSpec(max_new_tokens=8), rows)
  first = [int(t) for t in free.tokens_BxN[0]]
  stop = first[2]  # row 0 emits this at step 2 under greedy decoding
  spec = engine.GenerationSpec.with_stop_ids((stop,), max_new_tokens=8, pad_id=0)
  out, cache = _run(model, spec, rows)
  k = first.index(stop)
  # A stopped row consumes no more cache slots: the cache holds exactly prompt + turn.
  np.testing.assert_array_equal(cache.end_B, [len(r) for r in rows] + np.asarray(out.lengths_B))
  assert bool(out.stopped_B[0]) and int(out.lengths_B[0]) == k + 1
  np.testing.assert_array_equal(out.mask_BxN[0], np.arange(8) <= k)
  np.testing.assert_array_equal(out.tokens_BxN[0, : k + 1], first[: k + 1])
  assert (np.asarray(out.tokens_BxN[0, k + 1 :]) == 0).all()
  assert (np.asarray(out.logps_BxN[0, k + 1 :]) == 0).all()
  for i in (1, 2):  # other rows are unaffected unless they emit the stop token themselves
    gen = [int(t) for t in free.tokens_BxN[i]]
    n = gen.index(stop) + 1 if stop in gen else 8
    assert int(out.lengths_B[i]) == n and bool(out.stopped_B[i]) == (stop in gen)
    np.testing.assert_array_equal(out.tokens_BxN[i, :n], gen[:n])


def test_multi_token_stop_sequence(model):
  rows = [[3, 5, 7]]
  free, _ = _run(model, engine.GenerationSpec(max_new_tokens=8), rows)
  gen = [int(t) for t in free.tokens_BxN[0]]
  spec = engine.GenerationSpec(stop_sequences=((gen[3], gen[4]),), max_new_tokens=8)
  out, _ = _run(model, spec, rows)
  assert bool(out.stopped_B[0])
  assert int(out.lengths_B[0]) == next(j + 1 for j in range(1, 8) if gen[j - 1 : j + 1] == gen[3:5])


def test_inactive_rows_generate_nothing(model):
  out, _ = _run(
    model, engine.GenerationSpec(max_new_tokens=4), [[3, 4], [5, 6]], active=[True, False]
  )
  assert int(out.lengths_B[1]) == 0 and not np.asarray(out.mask_BxN[1]).any()
  assert int(out.lengths_B[0]) == 4


def test_cache_continuation_matches_rescoring_the_whole_sequence(model):
  """Turn 2 appends new tokens to rows that already hold turn 1; log-probs match a full re-score."""
  spec = engine.GenerationSpec(strategy=sampling.Temperature(1.0), max_new_tokens=5)
  turn1 = [[3, 5, 7, 11], [2, 4, 6, 8, 10, 12]]
  out1, cache = _run(model, spec, turn1, seed=1)
  seqs = [list(r) + [int(t) for t in out1.tokens_BxN[i]] for i, r in enumerate(turn1)]
  extra = [[20, 21, 22], [30]]  # the "environment's answer", different lengths per row
  width = 4
  tokens = np.zeros((2, width), np.int32)
  mask = np.zeros((2, width), bool)
  positions = np.zeros((2, width), np.int32)
  for i, e in enumerate(extra):
    tokens[i, : len(e)], mask[i, : len(e)] = e, True
    positions[i, : len(e)] = np.arange(len(seqs[i]), len(seqs[i]) + len(e))
  graphdef, state = nnx.split(model)
  fn = engine.make_generate_fn(graphdef, spec)
  args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(positions), jnp.ones(2, bool))
  out2, _ = fn(state, cache, *args, jax.random.key(2))
  full = [s + e + [int(t) for t in out2.tokens_BxN[i]] for i, (s, e) in enumerate(zip(seqs, extra))]
  ftok, fvalid, fpos = _right_padded(full, 24)
  scored, _ = reference.token_logps(model, ftok, fpos, fvalid, chunk_size=8)
  for i in range(2):
    start = len(seqs[i]) + len(extra[i])
    np.testing.assert_allclose(
      np.asarray(out2.logps_BxN[i]), np.asarray(scored[i, start : start + 5]), atol=2e-5
    )
    np.testing.assert_array_equal(out2.next_positions_B[i], start + 5)


def test_cache_is_donated(model):
  graphdef, state = nnx.split(model)
  fn = engine.make_generate_fn(graphdef, engine.GenerationSpec(max_new_tokens=2))
  cache = model_lib.init_cache(CFG, 1, 16)
  tokens, mask, positions = _right_padded([[1, 2]], 4)
  fn(state, cache, tokens, mask, positions, jnp.ones(1, bool), jax.random.key(0))
  assert cache.k.is_deleted()


def test_decode_loop_scanned_and_unrolled_agree(model):
  """``decode_layers``: the per-layer (unrolled) decode loop and the scanned one sample the same
  tokens with the same log-probs and leave the same cache."""
  rows = [[3, 5, 7, 11, 13], [2, 4], [17, 19, 23]]
  spec = engine.GenerationSpec(strategy=sampling.Temperature(1.0), max_new_tokens=6)
  outs = []
  for how in ("scan", "unrolled"):
    m = model_lib.Decoder(dataclasses.replace(CFG, decode_layers=how), rngs=nnx.Rngs(0))
    nnx.update(m, nnx.state(model))
    outs.append(_run(m, spec, rows, seed=5))
  (a, cache_a), (b, cache_b) = outs
  np.testing.assert_array_equal(np.asarray(a.tokens_BxN), np.asarray(b.tokens_BxN))
  np.testing.assert_allclose(np.asarray(a.logps_BxN), np.asarray(b.logps_BxN), atol=1e-6)
  np.testing.assert_allclose(np.asarray(cache_a.k), np.asarray(cache_b.k), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(cache_a.end_B), np.asarray(cache_b.end_B))
