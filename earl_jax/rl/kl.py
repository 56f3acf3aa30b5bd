"""Per-token KL estimators between a sampling policy and the reference (Schulman's k1/k2/k3).

Shared maths, not a stage: the update stage uses them for the in-loss KL term (``losses.py``,
GRPO) and the advantage stage for the KL penalty folded into the reward (``advantage.py``,
REINFORCE++). Both import them from here so the two stages never import each other.
"""

from __future__ import annotations

import enum

import jax.numpy as jnp

from earl_jax.types import Array

# exp() of a log-ratio above this overflows float32 gradients long before it is meaningful; k3 is
# computed on the log-ratio clamped to +-_MAX_LOG_RATIO (only pathological tokens are affected).
_MAX_LOG_RATIO = 20.0


class KLEstimator(enum.Enum):
  """Schulman's estimators of KL(q || p) from samples x ~ q, with log r = log p(x) - log q(x).

  k1 = -log r (unbiased, high variance, can be negative); k2 = (log r)^2 / 2 (biased, low
  variance); k3 = (r - 1) - log r (unbiased, low variance, always >= 0).
  """

  K1 = "k1"
  K2 = "k2"
  K3 = "k3"


def kl_per_token(
  logps_BxT: Array, ref_logps_BxT: Array, mask_BxT: Array, estimator: KLEstimator
) -> Array:
  """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi; 0 where mask is False.

  Args:
    logps_BxT: log pi(token) of the sampling policy (new policy in the loss, old policy when the
      KL is folded into the reward).
    ref_logps_BxT: log pi_ref(token) under the reference.
    mask_BxT: the loss mask; other entries may hold anything (they are never read).
    estimator: which of k1 / k2 / k3.
  """
  # log r = log pi_ref - log pi; zeroed off the mask first so padding cannot make inf or NaN.
  log_r_BxT = jnp.where(mask_BxT, ref_logps_BxT - logps_BxT, 0.0)
  if estimator is KLEstimator.K1:
    kl_BxT = -log_r_BxT
  elif estimator is KLEstimator.K2:
    kl_BxT = 0.5 * jnp.square(log_r_BxT)
  elif estimator is KLEstimator.K3:
    clamped_BxT = jnp.clip(log_r_BxT, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    kl_BxT = jnp.expm1(clamped_BxT) - clamped_BxT
  else:
    raise ValueError(f"estimator {estimator!r}; allowed: {[e.name for e in KLEstimator]}")
  return jnp.where(mask_BxT, kl_BxT, 0.0)
