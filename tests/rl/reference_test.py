"""Chunked reference log-probs: equal to unchunked ones; memory linear in T at a fixed chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.rl import reference

CFG = ModelConfig(
  vocab_size=61, embed_dim=24, mlp_dim=40, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=12,
  vocab_multiple=8,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
  return model_lib.Decoder(CFG, rngs=nnx.Rngs(1))


def _batch(lengths, t, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.vocab_size, size=(len(lengths), t)).astype(np.int32)
  valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
  positions = (np.broadcast_to(np.arange(t), tokens.shape) * valid).astype(np.int32)
  return jnp.asarray(np.where(valid, tokens, 0)), jnp.asarray(positions), jnp.asarray(valid)


def test_chunked_equals_unchunked_and_direct_log_softmax(model):
  tokens, positions, valid = _batch([16, 9, 1, 13], 16)
  logps = {}
  for chunk in (16, 8, 4, 1):
    logps[chunk], entropy = reference.token_logps(model, tokens, positions, valid, chunk_size=chunk)
    np.testing.assert_allclose(logps[chunk], logps[16], atol=1e-6)
  full = jax.nn.log_softmax(model_lib.logits(model, tokens), axis=-1)
  want = np.zeros(tokens.shape, np.float32)
  ent = np.zeros(tokens.shape, np.float32)
  for b in range(tokens.shape[0]):
    for t in range(1, int(valid[b].sum())):
      want[b, t] = full[b, t - 1, tokens[b, t]]
      p = np.exp(np.asarray(full[b, t - 1]))
      ent[b, t] = -(p * np.log(p)).sum()
  np.testing.assert_allclose(logps[4], want, atol=2e-5)
  np.testing.assert_allclose(entropy, ent, atol=2e-4)
  assert (np.asarray(logps[4])[~np.asarray(valid)] == 0).all()


def test_temperature_scales_logits(model):
  tokens, positions, valid = _batch([12, 12], 12, seed=1)
  hot, _ = reference.token_logps(model, tokens, positions, valid, chunk_size=4, temperature=2.0)
  full = jax.nn.log_softmax(model_lib.logits(model, tokens) / 2.0, axis=-1)
  want = jnp.take_along_axis(full[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  np.testing.assert_allclose(hot[:, 1:], want, atol=2e-5)


def test_restricted_scoring_is_the_renormalised_distribution(model):
  """With ``allowed``, each position's distribution is the model's (at the temperature)
  renormalised over those ids: the distribution ``sampling.Restricted`` samples from
  (tests/sampler/sampling_test.py checks the sampler against the same numpy reference)."""
  allowed = (3, 5, 11, 40)
  tokens, positions, valid = _batch([10, 7], 12, seed=3)
  tokens = jnp.asarray(np.asarray(allowed)[np.asarray(tokens) % len(allowed)] * np.asarray(valid))
  logps, entropy = reference.token_logps(
    model, tokens, positions, valid, chunk_size=4, temperature=0.7, allowed=allowed
  )
  z = np.asarray(model_lib.logits(model, tokens))[..., list(allowed)] / 0.7
  z = z - z.max(-1, keepdims=True)
  sub = z - np.log(np.exp(z).sum(-1, keepdims=True))  # log-softmax over the allowed ids
  for b in range(tokens.shape[0]):
    n = int(valid[b].sum())
    picked = [sub[b, i, allowed.index(int(tokens[b, i + 1]))] for i in range(n - 1)]
    np.testing.assert_allclose(logps[b, 1:n], picked, atol=2e-5)
    ent = -(np.exp(sub[b, : n - 1]) * sub[b, : n - 1]).sum(-1)
    np.testing.assert_allclose(entropy[b, 1:n], ent, atol=2e-5)
    assert (np.asarray(logps[b, n:]) == 0).all() and (np.asarray(entropy[b, n:]) == 0).all()


def test_answer_bits_score_each_token_among_the_answers_legal_on_its_turn(model):
  """``answer_bits_BxT`` on token t restricts the distribution t is drawn from (predicted at
  t - 1) to its legal answers: the per-row sampler's log-probs, across chunk boundaries."""
  allowed = (3, 5, 11, 40)
  tokens, positions, valid = _batch([10, 7], 12, seed=4)
  rng = np.random.default_rng(6)
  bits = rng.integers(1, 16, size=tokens.shape).astype(np.int32)
  # Every token is an answer legal under its own mask (the lowest set bit's id).
  low = np.asarray([[int(b & -b).bit_length() - 1 for b in row] for row in bits])
  tokens = jnp.asarray(np.asarray(allowed)[low] * np.asarray(valid), jnp.int32)
  logps, entropy = reference.token_logps(
    model, tokens, positions, valid, chunk_size=4, allowed=allowed, answer_bits_BxT=bits
  )
  z = np.asarray(model_lib.logits(model, tokens))[..., list(allowed)]
  for b in range(tokens.shape[0]):
    n = int(valid[b].sum())
    for i in range(1, n):
      legal = [j for j in range(len(allowed)) if bits[b, i] >> j & 1]
      sub = z[b, i - 1, legal] - z[b, i - 1, legal].max()
      sub = sub - np.log(np.exp(sub).sum())
      np.testing.assert_allclose(logps[b, i], sub[legal.index(low[b, i])], atol=2e-5)
      np.testing.assert_allclose(entropy[b, i], -(np.exp(sub) * sub).sum(), atol=2e-5)
  unmasked, _ = reference.token_logps(
    model, tokens, positions, valid, chunk_size=4, allowed=allowed,
    answer_bits_BxT=np.full(tokens.shape, -1, np.int32),
  )  # fmt: skip
  whole, _ = reference.token_logps(model, tokens, positions, valid, chunk_size=4, allowed=allowed)
  np.testing.assert_allclose(unmasked, whole, atol=1e-6)  # -1: the whole alphabet


def test_expert_logps_are_the_mass_on_the_experts_answers_among_the_legal_ones(model):
  """``expert_bits_BxT`` on token t: log of the probability, under the distribution t is drawn
  from (its turn's legal answers), of any of the expert's answers; 0 where there is no label."""
  allowed = (3, 5, 11, 40)
  tokens, positions, valid = _batch([10, 7], 12, seed=4)
  rng = np.random.default_rng(7)
  legal = rng.integers(1, 16, size=tokens.shape).astype(np.int32)
  expert = legal & rng.integers(0, 16, size=tokens.shape).astype(np.int32)  # a subset, or none
  assert (expert == 0).any() and (expert != 0).any()
  low = np.asarray([[int(b & -b).bit_length() - 1 for b in row] for row in legal])
  tokens = jnp.asarray(np.asarray(allowed)[low] * np.asarray(valid), jnp.int32)
  out = reference.scores(
    model, tokens, positions, valid, chunk_size=4, allowed=allowed, answer_bits_BxT=legal,
    expert_bits_BxT=expert,
  )  # fmt: skip
  logps, _ = reference.token_logps(
    model, tokens, positions, valid, chunk_size=4, allowed=allowed, answer_bits_BxT=legal
  )
  np.testing.assert_array_equal(out.logps_BxT, logps)  # the same pass
  z = np.asarray(model_lib.logits(model, tokens))[..., list(allowed)]
  for b in range(tokens.shape[0]):
    n = int(valid[b].sum())
    for i in range(1, n):
      p = np.where([legal[b, i] >> j & 1 for j in range(4)], np.exp(z[b, i - 1]), 0.0)
      on = [expert[b, i] >> j & 1 == 1 for j in range(4)]
      want = np.log(p[on].sum() / p.sum()) if any(on) else 0.0
      np.testing.assert_allclose(out.expert_logps_BxT[b, i], want, atol=2e-5)
    assert (np.asarray(out.expert_logps_BxT[b, n:]) == 0).all()
  with pytest.raises(TypeError, match="scores"):
    reference.token_logps(model, tokens, positions, valid, chunk_size=4, expert_bits_BxT=expert)


def test_gradients_flow_through_chunks(model):
  tokens, positions, valid = _batch([8, 5], 8, seed=2)
  graphdef, state = nnx.split(model)

  def loss(state, chunk):
    m = nnx.merge(graphdef, state)
    return reference.token_logps(m, tokens, positions, valid, chunk_size=chunk)[0].sum()

  g8 = jax.grad(loss)(state, 8)
  g2 = jax.grad(loss)(state, 2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g8, g2)


def test_rejects_length_not_multiple_of_chunk(model):
  tokens, positions, valid = _batch([5], 6)
  with pytest.raises(ValueError, match="multiple of chunk_size=4"):
    reference.token_logps(model, tokens, positions, valid, chunk_size=4)


def _peak_bytes(t: int, chunk: int, vocab: int) -> int:
  cfg = ModelConfig(
    vocab_size=vocab,
    embed_dim=16,
    mlp_dim=16,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=16,
    vocab_multiple=128,
    attention="chunked",
    attention_block=32,
  )  # fmt: skip  (32-token attention blocks: attention memory is linear here too)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.Decoder(cfg, rngs=nnx.Rngs(0))))

  def fn(state, tokens, positions, valid):
    return reference.token_logps(
      nnx.merge(graphdef, state), tokens, positions, valid, chunk_size=chunk
    )

  sds = jax.ShapeDtypeStruct
  args = (sds((1, t), jnp.int32), sds((1, t), jnp.int32), sds((1, t), jnp.bool_))
  mem = jax.jit(fn).lower(state, *args).compile().memory_analysis()
  # On CPU peak_memory_in_bytes leaves out temporaries (env_probe.md section 2).
  return (
    mem.argument_size_in_bytes
    + mem.output_size_in_bytes
    + mem.temp_size_in_bytes
    - mem.alias_size_in_bytes
  )


def test_peak_memory_grows_linearly_not_with_t_times_v():
  vocab, chunk = 8192, 32
  row = vocab * 4  # bytes that one more token adds to an unchunked [T, V] f32 logits tensor
  peaks = {t: _peak_bytes(t, chunk, vocab) for t in (128, 256, 512)}
  per_token = {t: (peaks[t] - peaks[128]) / (t - 128) for t in (256, 512)}
  # Fixed chunk: each extra token costs its activations (~D floats), not a row of logits.
  assert per_token[512] < row / 8, (peaks, per_token)
  assert peaks[512] - peaks[256] < 2.5 * (peaks[256] - peaks[128]) + row, peaks
  # The unchunked program does hold [T, V] (so the bound above can fail).
  unchunked = (_peak_bytes(512, 512, vocab) - _peak_bytes(128, 128, vocab)) / (512 - 128)
  assert unchunked >= row, unchunked
