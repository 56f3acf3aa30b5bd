"""Advantage estimators vs. independent numpy loops, edge cases, and sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from earl_jax.config_lib import ConfigError
from earl_jax.rl import advantage, batches
from earl_jax.rl.advantage import AdvantageConfig, AdvantageEstimator
from earl_jax.rl.kl import KLEstimator
from tests.rl.batches_test import random_scored_batch

EPS = 1e-6
compute = jax.jit(advantage.compute_advantages, static_argnames=("cfg", "num_groups"))


def np_sequence_advantages(sb: batches.ScoredBatch, kind: str, scale_by_std: bool = True):
  """GRPO / RLOO by explicit loops over groups; rows without policy tokens are left out."""
  mask = np.asarray(sb.loss_mask_BxT)
  rewards, gids = np.asarray(sb.rewards_B, np.float64), np.asarray(sb.group_ids_B)
  active = mask.any(1)
  adv_B = np.zeros(len(rewards))
  for i in range(len(rewards)):
    if not active[i]:
      continue
    members = [j for j in range(len(rewards)) if gids[j] == gids[i] and active[j]]
    group = rewards[members]
    if kind == "grpo":
      adv_B[i] = rewards[i] - group.mean()
      if scale_by_std:
        adv_B[i] /= group.std() + EPS
    elif len(members) > 1:  # rloo
      others = [rewards[j] for j in members if j != i]
      adv_B[i] = rewards[i] - np.mean(others)
  return np.where(mask, adv_B[:, None], 0.0)


def np_whiten(x, mask):
  vals = x[mask]
  return np.where(mask, (x - vals.mean()) / (vals.std() + EPS), 0.0)


def np_reinforce_pp(sb: batches.ScoredBatch, beta: float, gamma: float, per_turn: bool):
  mask = np.asarray(sb.loss_mask_BxT)
  old, ref = np.asarray(sb.old_logps_BxT, np.float64), np.asarray(sb.ref_logps_BxT, np.float64)
  b, t = mask.shape
  returns = np.zeros((b, t))
  for i in range(b):
    r = np.where(mask[i], -beta * (old[i] - ref[i]), 0.0)  # k1 = log pi_old - log pi_ref
    if per_turn:
      r = r + np.asarray(sb.token_rewards_BxT[i], np.float64)
    elif mask[i].any():
      r[np.nonzero(mask[i])[0][-1]] += sb.rewards_B[i]
    g = 0.0
    for j in reversed(range(t)):
      g = r[j] + (gamma if mask[i, j] else 1.0) * g
      returns[i, j] = g if mask[i, j] else 0.0
  return returns


GROUPS = [0, 1, 0, 2, 1, 2, 0, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_numpy(seed: int, scale_by_std: bool):
  sb = random_scored_batch(seed, GROUPS, empty_rows=(5,))
  cfg = AdvantageConfig(estimator=AdvantageEstimator.GRPO, scale_by_std=scale_by_std)
  ab = compute(jax.tree.map(jnp.asarray, sb), cfg, num_groups=3)
  want = np_sequence_advantages(sb, "grpo", scale_by_std)
  np.testing.assert_allclose(ab.advantages_BxT, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ab.returns_BxT, np.where(sb.loss_mask_BxT, sb.rewards_B[:, None], 0))
  assert np.all(np.asarray(ab.advantages_BxT)[5] == 0)  # fully masked row
  assert np.all(np.asarray(ab.advantages_BxT)[3] == 0)  # row 5 left group 2 with one sample


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_matches_numpy_incl_group_of_one(seed: int):
  groups = [0, 0, 1, 1, 1, 2, 3, 3]  # group 2 has one sample, 0 and 3 have two
  sb = random_scored_batch(seed, groups)
  ab = compute(jax.tree.map(jnp.asarray, sb), AdvantageConfig(estimator=AdvantageEstimator.RLOO))
  want = np_sequence_advantages(sb, "rloo")
  np.testing.assert_allclose(ab.advantages_BxT, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(ab.advantages_BxT)[5] == 0)
  # Group of 2: the advantages are +-(r0 - r1).
  d = sb.rewards_B[0] - sb.rewards_B[1]
  row0, row1 = np.asarray(ab.advantages_BxT)[:2]
  np.testing.assert_allclose(row0[sb.loss_mask_BxT[0]], d, rtol=1e-5)
  np.testing.assert_allclose(row1[sb.loss_mask_BxT[1]], -d, rtol=1e-5)


@pytest.mark.parametrize("estimator", [AdvantageEstimator.GRPO, AdvantageEstimator.RLOO])
def test_optional_whitening(estimator: AdvantageEstimator):
  sb = random_scored_batch(7, GROUPS)
  ab = compute(jax.tree.map(jnp.asarray, sb), AdvantageConfig(estimator=estimator, whiten=True))
  kind = "grpo" if estimator is AdvantageEstimator.GRPO else "rloo"
  mask = np.asarray(sb.loss_mask_BxT)
  want = np_whiten(np_sequence_advantages(sb, kind), mask)
  np.testing.assert_allclose(ab.advantages_BxT, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
  "estimator", [AdvantageEstimator.GRPO, AdvantageEstimator.RLOO, AdvantageEstimator.REINFORCE_PP]
)
def test_all_equal_rewards_give_exact_zero(estimator: AdvantageEstimator):
  sb = random_scored_batch(3, GROUPS, rewards=[0.1] * 8)
  sb = sb.replace(ref_logps_BxT=sb.old_logps_BxT)  # no KL either
  ab = compute(jax.tree.map(jnp.asarray, sb), AdvantageConfig(estimator=estimator, whiten=True))
  adv = np.asarray(ab.advantages_BxT)
  assert np.all(np.isfinite(adv))
  if estimator is AdvantageEstimator.REINFORCE_PP:
    # Returns differ only by row (each row's single reward at its end, gamma = 1): every policy
    # token of every row has return 0.1, so whitening gives exactly 0.
    np.testing.assert_allclose(np.asarray(ab.returns_BxT)[sb.loss_mask_BxT], 0.1, rtol=1e-6)
  np.testing.assert_array_equal(adv, np.zeros_like(adv))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("gamma", "per_turn"), [(1.0, False), (0.9, False), (0.95, True)])
def test_reinforce_pp_matches_numpy(seed: int, gamma: float, per_turn: bool):
  sb = random_scored_batch(seed, GROUPS, empty_rows=(2,))
  cfg = AdvantageConfig(
    estimator=AdvantageEstimator.REINFORCE_PP,
    kl_beta=0.05,
    kl_estimator=KLEstimator.K1,
    gamma=gamma,
    per_turn_rewards=per_turn,
  )
  ab = compute(jax.tree.map(jnp.asarray, sb), cfg)
  returns = np_reinforce_pp(sb, 0.05, gamma, per_turn)
  mask = np.asarray(sb.loss_mask_BxT)
  np.testing.assert_allclose(ab.returns_BxT, returns, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ab.advantages_BxT, np_whiten(returns, mask), rtol=1e-4, atol=1e-4)
  adv = np.asarray(ab.advantages_BxT)
  assert np.all(adv[~mask] == 0) and abs(adv[mask].mean()) < 1e-5


def test_rloo_static_degenerate_groups_raise():
  sb = jax.tree.map(jnp.asarray, random_scored_batch(0, [0, 1, 2, 3]))
  with pytest.raises(ValueError, match="RLOO needs groups of >= 2 samples"):
    compute(sb, AdvantageConfig(estimator=AdvantageEstimator.RLOO), num_groups=4)


def test_config_validation_names_field():
  with pytest.raises(ConfigError, match=r"'kl_beta'.*only REINFORCE_PP"):
    AdvantageConfig(estimator=AdvantageEstimator.GRPO, kl_beta=0.1)
  with pytest.raises(ConfigError, match="'gamma'"):
    AdvantageConfig(estimator=AdvantageEstimator.REINFORCE_PP, gamma=1.5)
  with pytest.raises(ConfigError, match="'estimator'"):
    AdvantageConfig(estimator="grpo")
  assert AdvantageConfig(estimator=AdvantageEstimator.REINFORCE_PP).whitening
  assert not AdvantageConfig().whitening
  assert set(advantage.ESTIMATORS) == set(AdvantageEstimator)


@pytest.mark.requires_devices(8)
@pytest.mark.parametrize(
  "estimator", [AdvantageEstimator.GRPO, AdvantageEstimator.RLOO, AdvantageEstimator.REINFORCE_PP]
)
def test_sharded_batch_gives_same_result(estimator: AdvantageEstimator):
  # 16 rows over 8 devices (2 rows each); every group's samples sit on different shards.
  groups = [i % 4 for i in range(16)]
  sb = random_scored_batch(11, groups, empty_rows=(9,))
  kwargs = {"kl_beta": 0.1} if estimator is AdvantageEstimator.REINFORCE_PP else {}
  cfg = AdvantageConfig(estimator=estimator, whiten=True, **kwargs)
  mesh = Mesh(np.asarray(jax.devices()[:8]), ("data",))
  sharded = jax.tree.map(
    lambda x: jax.device_put(
      x, NamedSharding(mesh, PartitionSpec("data", *([None] * (x.ndim - 1))))
    ),
    sb,
  )
  assert len(sharded.rewards_B.sharding.device_set) == 8
  single = jax.device_put(sb, jax.devices()[0])
  compute(sharded, cfg, num_groups=4)  # compile first; then the run itself must stay on device
  with jax.transfer_guard("disallow"):
    out_sharded = compute(sharded, cfg, num_groups=4)
  out_single = compute(single, cfg, num_groups=4)
  assert out_sharded.advantages_BxT.sharding.is_equivalent_to(sharded.tokens_BxT.sharding, 2)
  np.testing.assert_allclose(
    out_sharded.advantages_BxT, out_single.advantages_BxT, rtol=1e-6, atol=1e-6
  )
  np.testing.assert_allclose(out_sharded.returns_BxT, out_single.returns_BxT, rtol=1e-6, atol=0)
