"""KL estimators k1/k2/k3 vs. their formulas, and unbiasedness of k1/k3 on samples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.rl import kl
from earl_jax.rl.kl import KLEstimator

kl_per_token = jax.jit(kl.kl_per_token, static_argnames="estimator")


def np_kl(logp, ref, estimator: KLEstimator):
  log_r = ref - logp
  if estimator is KLEstimator.K1:
    return -log_r
  if estimator is KLEstimator.K2:
    return 0.5 * log_r**2
  return np.exp(log_r) - 1 - log_r


@pytest.mark.parametrize("estimator", list(KLEstimator))
def test_kl_estimators_match_formulas(estimator: KLEstimator):
  rng = np.random.default_rng(0)
  logp, ref = -rng.exponential(1, (4, 7)), -rng.exponential(1, (4, 7))
  mask = rng.random((4, 7)) < 0.7
  kl_BxT = kl_per_token(jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(mask), estimator=estimator)
  want = np.where(mask, np_kl(logp, ref, estimator), 0.0)
  np.testing.assert_allclose(kl_BxT, want, rtol=1e-5, atol=1e-6)
  if estimator is KLEstimator.K3:
    assert np.all(np.asarray(kl_BxT) >= 0)


def test_k1_and_k3_are_unbiased_estimates_of_true_kl():
  # Categorical q (the sampling policy) and p (reference) over 6 tokens; 200k samples from q.
  rng = np.random.default_rng(1)
  logq, logp = (np.log(rng.dirichlet(np.ones(6))) for _ in range(2))
  true_kl = float(np.sum(np.exp(logq) * (logq - logp)))
  x = rng.choice(6, size=(400, 500), p=np.exp(logq))
  mask = jnp.ones(x.shape, bool)
  for estimator in (KLEstimator.K1, KLEstimator.K3):
    kl_BxT = kl_per_token(jnp.asarray(logq[x]), jnp.asarray(logp[x]), mask, estimator=estimator)
    np.testing.assert_allclose(float(jnp.mean(kl_BxT)), true_kl, rtol=0.02)


def test_k3_stays_finite_for_extreme_log_ratios():
  logp = jnp.asarray([[-100.0, 0.0, -1e-3]])
  ref = jnp.asarray([[0.0, -100.0, -1e-3]])
  kl_BxT = kl_per_token(logp, ref, jnp.ones((1, 3), bool), estimator=KLEstimator.K3)
  assert np.all(np.isfinite(np.asarray(kl_BxT))) and float(kl_BxT[0, 2]) == 0.0
