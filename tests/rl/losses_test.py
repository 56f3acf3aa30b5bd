"""Policy losses vs. independent numpy loops: clipping, dual clip, KL estimators, aggregation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.config_lib import ConfigError
from earl_jax.rl import batches, losses
from earl_jax.rl.kl import KLEstimator
from earl_jax.rl.losses import LossAggregation, LossConfig
from tests.rl.batches_test import random_scored_batch
from tests.rl.kl_test import np_kl

loss_fn = jax.jit(losses.policy_loss, static_argnames="cfg")


def make_batch(seed: int, empty_rows: tuple[int, ...] = ()):
  """An AdvantageBatch with random advantages and new log-probs near the old ones."""
  sb = random_scored_batch(seed, [0, 0, 1, 1, 2, 2], t=10, empty_rows=empty_rows)
  rng = np.random.default_rng(seed + 100)
  mask = np.asarray(sb.loss_mask_BxT)
  adv = np.where(mask, rng.normal(size=mask.shape), 0.0).astype(np.float32)
  ab = batches.AdvantageBatch.from_scored(sb, adv, adv)
  # Ratios spread over ~[0.5, 2] so every clip branch is taken somewhere.
  new = np.where(mask, sb.old_logps_BxT + rng.normal(0, 0.4, mask.shape), 0.0)
  return jax.tree.map(jnp.asarray, ab), jnp.asarray(new, jnp.float32)


def np_token_losses(new, ab, cfg: LossConfig, entropy=None):
  """Per-token loss by an explicit loop over tokens (0 off the mask)."""
  mask = np.asarray(ab.loss_mask_BxT)
  old, ref = np.asarray(ab.old_logps_BxT, np.float64), np.asarray(ab.ref_logps_BxT, np.float64)
  adv, new = np.asarray(ab.advantages_BxT, np.float64), np.asarray(new, np.float64)
  out = np.zeros(mask.shape)
  for i, j in zip(*np.nonzero(mask)):
    a, ratio = adv[i, j], np.exp(new[i, j] - old[i, j])
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    pg = max(-a * ratio, -a * min(max(ratio, lo), hi))
    if cfg.dual_clip is not None and a < 0:
      pg = min(pg, -cfg.dual_clip * a)
    pg += cfg.kl_beta * np_kl(new[i, j], ref[i, j], cfg.kl_estimator)
    if entropy is not None:
      pg -= cfg.entropy_coef * entropy[i, j]
    out[i, j] = pg
  return out, mask


def np_aggregate(loss, mask, mode: LossAggregation, norm=None):
  if mode is LossAggregation.TOKEN_MEAN:
    return loss[mask].sum() / max(mask.sum(), 1)
  if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
    rows = [loss[i][mask[i]].mean() for i in range(len(mask)) if mask[i].any()]
    return float(np.mean(rows)) if rows else 0.0
  return loss[mask].sum() / (loss.shape[0] * (loss.shape[1] if norm is None else norm))


CONFIGS = [
  LossConfig(),
  LossConfig(clip_eps_low=0.2, clip_eps_high=0.28),  # clip-higher
  LossConfig(clip_eps_low=0.1, clip_eps_high=0.3, dual_clip=1.5),
  LossConfig(kl_beta=0.1, kl_estimator=KLEstimator.K3),  # GRPO
  LossConfig(kl_beta=0.2, kl_estimator=KLEstimator.K2, entropy_coef=0.01),
  LossConfig(aggregation=LossAggregation.SEQ_MEAN_TOKEN_MEAN, kl_beta=0.05),
  LossConfig(aggregation=LossAggregation.SEQ_SUM_NORM, kl_estimator=KLEstimator.K1, kl_beta=0.1),
  LossConfig(aggregation=LossAggregation.SEQ_SUM_NORM, seq_sum_norm=32, dual_clip=3.0),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_policy_loss_matches_numpy(seed: int, cfg: LossConfig):
  ab, new = make_batch(seed, empty_rows=(3,))
  entropy = jnp.asarray(np.random.default_rng(seed).uniform(0, 3, new.shape), jnp.float32)
  loss, metrics = loss_fn(new, ab, cfg, entropy)
  token_loss, mask = np_token_losses(new, ab, cfg, entropy if cfg.entropy_coef else None)
  want = np_aggregate(token_loss, mask, cfg.aggregation, cfg.seq_sum_norm)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  ratio = np.exp(np.asarray(new) - np.asarray(ab.old_logps_BxT))[mask]
  np.testing.assert_allclose(metrics["ratio_mean"], ratio.mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["ratio_max"], ratio.max(), rtol=1e-5)
  np.testing.assert_allclose(metrics["ratio_min"], ratio.min(), rtol=1e-5)
  np.testing.assert_allclose(metrics["entropy"], np.asarray(entropy)[mask].mean(), rtol=1e-5)
  assert metrics["num_tokens"] == mask.sum()


def test_clip_fractions_count_only_policy_tokens():
  cfg = LossConfig(clip_eps_low=0.1, clip_eps_high=0.2, dual_clip=2.0)
  ab, new = make_batch(5)
  _, metrics = loss_fn(new, ab, cfg)
  mask = np.asarray(ab.loss_mask_BxT)
  ratio = np.exp(np.asarray(new) - np.asarray(ab.old_logps_BxT))
  adv = np.asarray(ab.advantages_BxT)
  # Clipped branch chosen: ratio beyond the bound on the side the advantage pushes towards.
  clipped = mask & (((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.9)))
  dual = mask & (adv < 0) & (ratio > 2.0)
  assert clipped.any() and dual.any()
  np.testing.assert_allclose(metrics["clip_frac"], clipped.sum() / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(metrics["dual_clip_frac"], dual.sum() / mask.sum(), rtol=1e-6)


@pytest.mark.parametrize("aggregation", list(LossAggregation))
def test_ppo_gradient_matches_analytic_form(aggregation: LossAggregation):
  cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0, aggregation=aggregation)
  ab, new = make_batch(3, empty_rows=(1,))
  grad = jax.jit(jax.grad(lambda n: losses.policy_loss(n, ab, cfg)[0]))(new)
  mask = np.asarray(ab.loss_mask_BxT)
  ratio = np.exp(np.asarray(new, np.float64) - np.asarray(ab.old_logps_BxT))
  adv = np.asarray(ab.advantages_BxT, np.float64)
  inside = (ratio > 0.8) & (ratio < 1.28)
  active = (inside | ((adv > 0) & (ratio <= 0.8)) | ((adv < 0) & (ratio >= 1.28))) & mask
  active &= ~((adv < 0) & (ratio > 3.0))  # dual clip: constant -c*A, no gradient
  # d/dlogp of -A * ratio = -A * ratio on active tokens, times the aggregation weight.
  if aggregation is LossAggregation.TOKEN_MEAN:
    weight = np.full(mask.shape, 1.0 / mask.sum())
  elif aggregation is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
    rows = mask.any(1).sum()
    weight = 1.0 / (rows * np.maximum(mask.sum(1, keepdims=True), 1)) * np.ones(mask.shape)
  else:
    weight = np.full(mask.shape, 1.0 / mask.size)
  want = np.where(active, -adv * ratio * weight, 0.0)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_loss_gradient_matches_finite_differences_with_kl():
  cfg = LossConfig(kl_beta=0.3, kl_estimator=KLEstimator.K3, dual_clip=2.0)
  ab, new = make_batch(4)
  ab = jax.tree.map(lambda x: np.asarray(x, np.float64) if x.dtype == np.float32 else x, ab)
  with jax.enable_x64(True):
    f = jax.jit(lambda n: losses.policy_loss(n, ab, cfg)[0])
    new64 = jnp.asarray(new, jnp.float64)
    grad = np.asarray(jax.grad(f)(new64))
    mask = np.asarray(ab.loss_mask_BxT)
    for i, j in list(zip(*np.nonzero(mask)))[:12]:
      h = 1e-6
      up, down = new64.at[i, j].add(h), new64.at[i, j].add(-h)
      fd = (float(f(up)) - float(f(down))) / (2 * h)
      np.testing.assert_allclose(grad[i, j], fd, rtol=1e-4, atol=1e-8)
  assert np.all(grad[~mask] == 0)


def test_garbage_off_mask_does_not_leak():
  ab, new = make_batch(6, empty_rows=(0,))
  mask = np.asarray(ab.loss_mask_BxT)
  noisy = jnp.where(mask, new, 1e4)  # huge off-mask log-probs would overflow exp()
  cfg = LossConfig(kl_beta=0.1, dual_clip=2.0)
  (loss, metrics), grad = jax.jit(
    jax.value_and_grad(lambda n: losses.policy_loss(n, ab, cfg), has_aux=True)
  )(noisy)
  np.testing.assert_allclose(loss, loss_fn(new, ab, cfg)[0], rtol=1e-6)
  assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[~mask] == 0)
  assert all(np.isfinite(float(v)) for v in metrics.values())


def test_empty_batch_gives_zero_loss_and_finite_metrics():
  ab, new = make_batch(0, empty_rows=tuple(range(6)))
  for mode in LossAggregation:
    loss, metrics = loss_fn(new, ab, LossConfig(aggregation=mode))
    assert float(loss) == 0.0
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_config_validation_and_missing_entropy():
  with pytest.raises(ConfigError, match="'dual_clip'"):
    LossConfig(dual_clip=1.0)
  with pytest.raises(ConfigError, match="'clip_eps_high'"):
    LossConfig(clip_eps_high=1.5)
  with pytest.raises(ConfigError, match="'aggregation'"):
    LossConfig(aggregation="token_mean")
  with pytest.raises(ConfigError, match="'seq_sum_norm'"):
    LossConfig(seq_sum_norm=0)
  ab, new = make_batch(0)
  with pytest.raises(ValueError, match=r"entropy_coef=0\.1 > 0 needs entropy_BxT"):
    losses.policy_loss(new, ab, LossConfig(entropy_coef=0.1))
