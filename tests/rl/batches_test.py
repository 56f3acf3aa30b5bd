"""Tests of the stage batch contracts; provides ``random_scored_batch`` to the RL maths tests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from earl_jax.rl import batches
from earl_jax.types import BATCH, SEQ


def random_scored_batch(
  seed: int,
  group_ids: list[int],
  t: int = 12,
  *,
  rewards: list[float] | None = None,
  empty_rows: tuple[int, ...] = (),
) -> batches.ScoredBatch:
  """A numpy ScoredBatch: each row = prompt, 1-2 model turns with an env turn between, padding."""
  rng = np.random.default_rng(seed)
  b = len(group_ids)
  valid = np.zeros((b, t), bool)
  loss_mask = np.zeros((b, t), bool)
  token_rewards = np.zeros((b, t), np.float32)
  for i in range(b):
    n = int(rng.integers(t // 2, t + 1))
    valid[i, :n] = True
    prompt = int(rng.integers(1, 3))
    if i in empty_rows:
      continue
    cut = int(rng.integers(prompt + 1, n)) if n - prompt > 2 else n
    loss_mask[i, prompt:cut] = True  # first model turn
    token_rewards[i, cut - 1] = rng.normal()
    if n - cut > 2:  # env turn of 1 token, then a second model turn
      loss_mask[i, cut + 1 : n] = True
      token_rewards[i, n - 1] = rng.normal()
  rewards_B = (token_rewards.sum(1) if rewards is None else np.asarray(rewards, np.float32)).astype(
    np.float32
  )

  def logps() -> np.ndarray:
    return np.where(loss_mask, -rng.exponential(1.0, (b, t)), 0.0).astype(np.float32)

  rb = batches.RolloutBatch(
    tokens_BxT=np.where(valid, rng.integers(1, 50, (b, t)), 0).astype(np.int32),
    positions_BxT=(np.arange(t)[None, :] * valid).astype(np.int32),
    valid_BxT=valid,
    loss_mask_BxT=loss_mask,
    sampler_logps_BxT=logps(),
    rewards_B=rewards_B,
    group_ids_B=np.asarray(group_ids, np.int32),
    token_rewards_BxT=token_rewards,
    answer_bits_BxT=np.full((b, t), -1, np.int32),
    expert_bits_BxT=np.zeros((b, t), np.int32),
  )
  return batches.ScoredBatch.from_rollout(rb, ref_logps_BxT=logps(), old_logps_BxT=logps())


def test_from_constructors_carry_every_field():
  sb = random_scored_batch(0, [0, 0, 1, 1]).validate().validate_values(num_groups=2)
  adv = np.ones((4, 12), np.float32)
  ab = batches.AdvantageBatch.from_scored(sb, adv, 2 * adv).validate()
  for f in dataclasses.fields(sb):
    assert getattr(ab, f.name) is getattr(sb, f.name), f.name
  assert isinstance(ab, batches.ScoredBatch) and isinstance(ab, batches.RolloutBatch)
  assert ab.batch_size == 4 and ab.seq_len == 12


def test_create_fills_zero_token_rewards():
  sb = random_scored_batch(1, [0, 1])
  fields = {
    k: v
    for k, v in sb.field_dict().items()
    if k not in ("token_rewards_BxT", "ref_logps_BxT", "old_logps_BxT")
  }
  rb = batches.RolloutBatch.create(**fields).validate()
  np.testing.assert_array_equal(rb.token_rewards_BxT, np.zeros((2, 12), np.float32))


def test_logical_axes_follow_suffixes_and_match_structure():
  axes = batches.AdvantageBatch.logical_axes()
  assert axes.tokens_BxT == PartitionSpec(BATCH, SEQ)
  assert axes.rewards_B == PartitionSpec(BATCH)
  assert axes.advantages_BxT == PartitionSpec(BATCH, SEQ)
  sb = random_scored_batch(2, [0, 0])
  ab = batches.AdvantageBatch.from_scored(sb, sb.old_logps_BxT, sb.old_logps_BxT)
  # Zipping batch and axes must work leaf-for-leaf (what the dispatcher does).
  ranks = jax.tree.map(lambda x, spec: (x.ndim, len(spec)), ab, axes)
  assert all(r == s for r, s in jax.tree.leaves(ranks, is_leaf=lambda n: isinstance(n, tuple)))


def test_validate_names_bad_shape_and_dtype():
  sb = random_scored_batch(3, [0, 0, 1])
  with pytest.raises(ValueError, match=r"ScoredBatch.ref_logps_BxT has shape \(3, 11\)"):
    sb.replace(ref_logps_BxT=sb.ref_logps_BxT[:, :11]).validate()
  with pytest.raises(ValueError, match=r"rewards_B has shape \(2,\); expected \(3,\)"):
    sb.replace(rewards_B=sb.rewards_B[:2]).validate()
  with pytest.raises(ValueError, match="loss_mask_BxT has dtype int32; expected bool"):
    sb.replace(loss_mask_BxT=sb.loss_mask_BxT.astype(np.int32)).validate()
  with pytest.raises(ValueError, match=r"tokens_BxT must have shape \[B, T\]"):
    sb.replace(tokens_BxT=sb.tokens_BxT[0]).validate()


def test_validate_values_rejects_bad_group_ids_and_mask():
  sb = random_scored_batch(4, [0, 1, 2])
  with pytest.raises(ValueError, match=r"group_ids_B has values \[2\]; allowed: \[0, 2\)"):
    sb.validate_values(num_groups=2)
  bad_mask = sb.loss_mask_BxT | ~sb.valid_BxT
  with pytest.raises(ValueError, match="loss_mask_BxT is True on padding"):
    sb.replace(loss_mask_BxT=bad_mask).validate_values()


def test_batch_is_a_pytree_through_jit():
  sb = jax.tree.map(jnp.asarray, random_scored_batch(5, [0, 0, 1, 1]))

  @jax.jit
  def f(batch: batches.ScoredBatch) -> batches.ScoredBatch:
    batch.validate()  # static checks work on tracers
    return batch.replace(rewards_B=batch.rewards_B + 1.0)

  out = f(sb)
  assert isinstance(out, batches.ScoredBatch)
  np.testing.assert_allclose(out.rewards_B, np.asarray(sb.rewards_B) + 1.0)
  assert out.tokens_BxT.dtype == jnp.int32
