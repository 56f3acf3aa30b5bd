"""Sampling strategies: the distribution each one samples from, checked against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.config_lib import ConfigError
from earl_jax.sampler import sampling


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_processed(strategy, logits: np.ndarray) -> np.ndarray:
  """Reference: log-probs of the distribution each strategy should sample from (-inf = excluded)."""
  t = getattr(strategy, "temperature", 1.0)
  z = logits / t
  if isinstance(strategy, sampling.TopK):
    kth = np.sort(z, -1)[:, -strategy.k][:, None]
    z = np.where(z >= kth, z, -np.inf)
  if isinstance(strategy, sampling.TopP):
    p = np.exp(_np_log_softmax(z))
    out = np.full_like(z, -np.inf)
    for b in range(z.shape[0]):
      order = np.argsort(-p[b], kind="stable")
      mass = 0.0
      for i in order:
        if mass >= strategy.p:
          break
        out[b, i] = z[b, i]
        mass += p[b, i]
    z = out
  return _np_log_softmax(z)


@pytest.mark.parametrize(
  "strategy",
  [
    sampling.Temperature(1.0),
    sampling.Temperature(0.7),
    sampling.TopK(3, 1.3),
    sampling.TopK(1),
    sampling.TopP(0.6, 0.9),
    sampling.TopP(1.0),
  ],
  ids=str,
)
def test_processed_distribution_matches_numpy(strategy):
  logits = np.random.default_rng(0).normal(size=(5, 11)).astype(np.float32) * 2
  got = jax.nn.log_softmax(strategy.process(jnp.asarray(logits)), axis=-1)
  want = _np_processed(strategy, logits)
  kept = np.isfinite(want)
  np.testing.assert_array_equal(np.asarray(got) > -1e20, kept)
  np.testing.assert_allclose(np.asarray(got)[kept], want[kept], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", [sampling.TopK(4, 0.8), sampling.TopP(0.7, 1.2)], ids=str)
def test_sampled_tokens_follow_the_distribution_and_logps_are_exact(strategy):
  logits = np.random.default_rng(1).normal(size=(1, 7)).astype(np.float32) * 1.5
  want = np.exp(_np_processed(strategy, logits))[0]
  keys = jax.random.split(jax.random.key(0), 20000)
  toks, logps = jax.jit(jax.vmap(lambda k: strategy.sample(jnp.asarray(logits), k)))(keys)
  freq = np.bincount(np.asarray(toks)[:, 0], minlength=7) / len(keys)
  np.testing.assert_allclose(freq, want, atol=0.015)
  np.testing.assert_allclose(
    np.exp(np.asarray(logps)[:, 0]), want[np.asarray(toks)[:, 0]], rtol=1e-5
  )


def test_greedy_is_argmax_with_model_logprob():
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(4, 9)), jnp.float32)
  toks, logps = sampling.Greedy().sample(logits, jax.random.key(0))
  np.testing.assert_array_equal(toks, np.argmax(logits, -1))
  np.testing.assert_allclose(logps, _np_log_softmax(np.asarray(logits)).max(-1), rtol=1e-6)


@pytest.mark.parametrize("inner", [sampling.Temperature(0.8), sampling.TopK(2, 1.0)], ids=str)
def test_restricted_samples_only_allowed_tokens_with_their_renormalised_logps(inner):
  logits = np.random.default_rng(3).normal(size=(1, 9)).astype(np.float32) * 2
  allowed = (1, 4, 6, 7)
  strategy = sampling.make_strategy(
    type(inner).__name__.lower().replace("topk", "top_k"),
    temperature=inner.temperature,
    top_k=getattr(inner, "k", 0),
    allowed=allowed,
  )
  assert strategy == sampling.Restricted(inner, allowed)
  masked = np.full_like(logits, -np.inf)
  masked[:, allowed] = logits[:, allowed]
  want = np.exp(_np_processed(inner, masked))[0]  # the inner strategy on the allowed tokens only
  keys = jax.random.split(jax.random.key(1), 20000)
  toks, logps = jax.jit(jax.vmap(lambda k: strategy.sample(jnp.asarray(logits), k)))(keys)
  toks = np.asarray(toks)[:, 0]
  assert set(np.unique(toks)) <= set(allowed)
  freq = np.bincount(toks, minlength=9) / len(keys)
  np.testing.assert_allclose(freq, want, atol=0.015)
  np.testing.assert_allclose(np.exp(np.asarray(logps)[:, 0]), want[toks], rtol=1e-5)


def test_restricted_greedy_is_the_argmax_of_the_allowed_tokens():
  logits = jnp.asarray(np.random.default_rng(4).normal(size=(6, 9)), jnp.float32)
  allowed = (0, 2, 3, 8)
  toks, logps = sampling.Restricted(sampling.Greedy(), allowed).sample(logits, jax.random.key(0))
  sub = np.asarray(logits)[:, allowed]
  np.testing.assert_array_equal(toks, np.asarray(allowed)[np.argmax(sub, -1)])
  np.testing.assert_allclose(logps, _np_log_softmax(sub).max(-1), rtol=1e-6)


def test_per_row_answer_bits_narrow_each_row_to_its_legal_answers():
  """Row r may play only the answers whose bit is set; its log-prob is renormalised over them.
  A row with no bit of the alphabet set keeps the whole alphabet (never the whole vocabulary)."""
  logits = jnp.asarray(np.random.default_rng(5).normal(size=(4, 9)) * 2, jnp.float32)
  allowed = (0, 2, 3, 8)
  bits = jnp.asarray([0b0001, 0b1010, 0b1100, 0], jnp.int32)
  strategy = sampling.make_strategy("temperature", allowed=allowed, per_row=True)
  assert strategy == sampling.Restricted(sampling.Temperature(1.0), allowed, per_row=True)
  assert sampling.needs_answer_bits(strategy)
  keys = jax.random.split(jax.random.key(2), 4000)
  toks, logps = jax.jit(jax.vmap(lambda k: strategy.sample(logits, k, bits)))(keys)
  toks, logps = np.asarray(toks), np.asarray(logps)
  legal = [[0], [2, 8], [3, 8], list(allowed)]
  for r, ids in enumerate(legal):
    assert set(np.unique(toks[:, r])) == set(ids), r  # every legal one is drawn, nothing else
    sub = np.asarray(logits)[r, ids]
    want = dict(zip(ids, _np_log_softmax(sub[None])[0]))
    np.testing.assert_allclose(logps[:, r], [want[t] for t in toks[:, r]], rtol=1e-5, atol=1e-6)
  greedy = sampling.Restricted(sampling.Greedy(), allowed, per_row=True)
  g, _ = greedy.sample(logits, jax.random.key(0), bits)
  want = [ids[int(np.argmax(np.asarray(logits)[r, ids]))] for r, ids in enumerate(legal)]
  np.testing.assert_array_equal(g, want)
  with pytest.raises(ValueError, match="per_row=True"):
    strategy.sample(logits, jax.random.key(0))  # the bits are required, never silently dropped
  with pytest.raises(ValueError, match="per_row=False"):
    sampling.Restricted(sampling.Greedy(), allowed).sample(logits, jax.random.key(0), bits)
  with pytest.raises(ConfigError, match="per_row"):
    sampling.make_strategy("greedy", per_row=True)


def test_restricted_rejects_bad_token_sets():
  for bad in ((), (1, 1), (-1, 2)):
    with pytest.raises(ConfigError):
      sampling.Restricted(sampling.Greedy(), bad)
  with pytest.raises(ValueError, match=r"subset of \[0, 9\)"):
    sampling.restrict(jnp.zeros((2, 9)), (3, 9))


@pytest.mark.parametrize(
  ("kwargs", "key"),
  [
    ({"name": "temperature", "temperature": 0.0}, "temperature"),
    ({"name": "top_k", "top_k": 0}, "k"),
    ({"name": "top_p", "top_p": 1.5}, "p"),
    ({"name": "beam"}, "strategy"),
  ],
)
def test_bad_strategy_values_are_named(kwargs, key):
  with pytest.raises(ConfigError) as err:
    sampling.make_strategy(**kwargs)
  assert err.value.key == key
