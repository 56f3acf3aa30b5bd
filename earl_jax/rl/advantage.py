"""Advantage estimation: ScoredBatch -> AdvantageBatch, jitted on device over the sharded batch.

Data flow: reference stage -> ``ScoredBatch`` -> ``compute_advantages`` -> ``AdvantageBatch`` ->
dispatch -> update. Nothing passes through the host: group statistics use segment reductions
with a static number of groups, so a group whose samples sit on different shards is reduced by
XLA's collectives, giving the same numbers as on one device.

Estimators (``AdvantageEstimator``, looked up in ``ESTIMATORS``; no free-form strings):
  GRPO          A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g with scale_by_std=False
                (Dr. GRPO). Population std (ddof 0).
  RLOO          A_i = r_i - mean of the *other* samples of the group = n/(n-1) (r_i - mean_g).
  REINFORCE_PP  REINFORCE++ (the EARL paper's estimator): per-token rewards
                r_t = -beta KL_t(pi_old || pi_ref) on every policy token plus the episode reward
                on the last policy token (or the per-turn rewards, ``per_turn_rewards``);
                A_t = return-to-go sum_k gamma^k r_{t+k} over policy tokens, then whitened over
                all policy tokens of the batch.

Edge-case rules (all NaN-free):
  * Rows without any policy token (fully masked, e.g. batch padding) are left out of every
    statistic and get advantage 0.
  * Equal rewards within a group give exactly 0 (values are shifted by the group max before the
    mean, so the subtraction is exact); the std is then 0 and eps keeps the division finite.
  * A group with one (participating) sample: GRPO gives 0 (r - mean = 0); RLOO has no baseline
    and gives 0. ``compute_advantages`` raises at trace time for RLOO when the caller's static
    ``num_groups >= B``, i.e. when no group can have two samples.
  * Whitening with zero spread gives 0.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from earl_jax.rl.batches import AdvantageBatch, ScoredBatch
from earl_jax.rl.kl import KLEstimator, kl_per_token
from earl_jax.types import Array, ConfigError


class AdvantageEstimator(enum.Enum):
  GRPO = "grpo"
  RLOO = "rloo"
  REINFORCE_PP = "reinforce_pp"


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Static configuration of ``compute_advantages`` (hashable: pass it as a static jit argument)."""

  estimator: AdvantageEstimator = AdvantageEstimator.GRPO
  scale_by_std: bool = True  # GRPO: divide by the group std; False = Dr. GRPO (centre only)
  whiten: bool | None = None  # batch-global whitening over policy tokens; None = the estimator's
  # default (on for REINFORCE_PP, off for GRPO and RLOO)
  eps: float = 1e-6  # added to every std before dividing
  kl_beta: float = 0.0  # beta: KL penalty folded into the reward (REINFORCE_PP only)
  kl_estimator: KLEstimator = KLEstimator.K1  # estimator of that KL(pi_old || pi_ref)
  gamma: float = 1.0  # gamma: discount per policy token (REINFORCE_PP only)
  per_turn_rewards: bool = False  # REINFORCE_PP: reward from token_rewards_BxT (one per turn)
  # instead of rewards_B on the last policy token

  def __post_init__(self):
    if not isinstance(self.estimator, AdvantageEstimator):
      raise ConfigError("estimator", self.estimator, f"one of {list(AdvantageEstimator)}")
    if not isinstance(self.kl_estimator, KLEstimator):
      raise ConfigError("kl_estimator", self.kl_estimator, f"one of {list(KLEstimator)}")
    if not self.eps > 0:
      raise ConfigError("eps", self.eps, "a positive float")
    if not self.kl_beta >= 0:
      raise ConfigError("kl_beta", self.kl_beta, "a non-negative float")
    if not 0.0 < self.gamma <= 1.0:
      raise ConfigError("gamma", self.gamma, "a float in (0, 1]")
    if self.estimator is not AdvantageEstimator.REINFORCE_PP:
      # These only shape token-level returns; silently ignoring them would hide a config mistake.
      for key, value, default in (
        ("kl_beta", self.kl_beta, 0.0),
        ("gamma", self.gamma, 1.0),
        ("per_turn_rewards", self.per_turn_rewards, False),
      ):
        if value != default:
          raise ConfigError(
            key,
            value,
            f"{default!r} with estimator {self.estimator.name} (only REINFORCE_PP uses it; "
            "for GRPO put the KL in the loss: LossConfig.kl_beta)",
          )

  @property
  def whitening(self) -> bool:
    if self.whiten is None:
      return self.estimator is AdvantageEstimator.REINFORCE_PP
    return self.whiten


# (batch, cfg, num_groups) -> (advantages_BxT, returns_BxT), both 0 off the loss mask.
EstimatorFn = Callable[[ScoredBatch, AdvantageConfig, int], tuple[Array, Array]]


def _participating(batch: ScoredBatch) -> Array:
  """bool [B]: rows with at least one policy token; only they enter statistics."""
  return jnp.any(batch.loss_mask_BxT, axis=1)


def group_centered(
  values_B: Array, weight_B: Array, group_ids_B: Array, num_groups: int
) -> tuple[Array, Array, Array]:
  """Per row: value - group mean, the group std and the group size (over rows with weight).

  Rows with ``weight_B`` False get 0 deviation and do not count. Values are first shifted by
  their group's max so that equal values cancel exactly (no 1e-8 residue divided by eps).
  """
  w_B = weight_B.astype(values_B.dtype)
  shift_G = jax.ops.segment_max(
    jnp.where(weight_B, values_B, -jnp.inf), group_ids_B, num_segments=num_groups
  )
  x_B = jnp.where(weight_B, values_B - shift_G[group_ids_B], 0.0)
  count_G = jax.ops.segment_sum(w_B, group_ids_B, num_segments=num_groups)
  mean_G = jax.ops.segment_sum(x_B, group_ids_B, num_segments=num_groups) / jnp.maximum(
    count_G, 1.0
  )
  dev_B = jnp.where(weight_B, x_B - mean_G[group_ids_B], 0.0)
  var_G = jax.ops.segment_sum(jnp.square(dev_B), group_ids_B, num_segments=num_groups)
  std_G = jnp.sqrt(var_G / jnp.maximum(count_G, 1.0))
  return dev_B, std_G[group_ids_B], count_G[group_ids_B]


def whiten(x_BxT: Array, mask_BxT: Array, eps: float) -> Array:
  """(x - mean) / (std + eps) with mean and std over all masked entries of the batch; 0 off-mask."""
  m_BxT = mask_BxT.astype(x_BxT.dtype)
  n = jnp.maximum(jnp.sum(m_BxT), 1.0)
  # Shift by the max first for the same exact-cancellation reason as group_centered.
  shifted_BxT = jnp.where(mask_BxT, x_BxT - jnp.max(jnp.where(mask_BxT, x_BxT, -jnp.inf)), 0.0)
  dev_BxT = jnp.where(mask_BxT, shifted_BxT - jnp.sum(shifted_BxT) / n, 0.0)
  std = jnp.sqrt(jnp.sum(jnp.square(dev_BxT)) / n)
  return dev_BxT / (std + eps)


def _broadcast(values_B: Array, mask_BxT: Array) -> Array:
  return jnp.where(mask_BxT, values_B[:, None], 0.0)


def _grpo(batch: ScoredBatch, cfg: AdvantageConfig, num_groups: int) -> tuple[Array, Array]:
  dev_B, std_B, _ = group_centered(
    batch.rewards_B, _participating(batch), batch.group_ids_B, num_groups
  )
  adv_B = dev_B / (std_B + cfg.eps) if cfg.scale_by_std else dev_B
  mask_BxT = batch.loss_mask_BxT
  return _broadcast(adv_B, mask_BxT), _broadcast(batch.rewards_B, mask_BxT)


def _rloo(batch: ScoredBatch, cfg: AdvantageConfig, num_groups: int) -> tuple[Array, Array]:
  del cfg
  dev_B, _, n_B = group_centered(
    batch.rewards_B, _participating(batch), batch.group_ids_B, num_groups
  )
  # r_i - (sum - r_i)/(n-1) == n/(n-1) * (r_i - mean); groups of one have no baseline -> 0.
  adv_B = jnp.where(n_B > 1, dev_B * n_B / jnp.maximum(n_B - 1.0, 1.0), 0.0)
  mask_BxT = batch.loss_mask_BxT
  return _broadcast(adv_B, mask_BxT), _broadcast(batch.rewards_B, mask_BxT)


def token_rewards(batch: ScoredBatch, cfg: AdvantageConfig) -> Array:
  """REINFORCE++ per-token rewards: -beta * KL_t on policy tokens plus the task reward."""
  mask_BxT = batch.loss_mask_BxT
  kl_BxT = kl_per_token(batch.old_logps_BxT, batch.ref_logps_BxT, mask_BxT, cfg.kl_estimator)
  rewards_BxT = -cfg.kl_beta * kl_BxT
  if cfg.per_turn_rewards:
    return rewards_BxT + batch.token_rewards_BxT
  t = mask_BxT.shape[1]
  t_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], mask_BxT.shape)
  last_B = jnp.max(jnp.where(mask_BxT, t_BxT, -1), axis=1)  # -1: no policy token, no reward
  is_last_BxT = t_BxT == last_B[:, None]
  return rewards_BxT + jnp.where(is_last_BxT, batch.rewards_B[:, None], 0.0)


def discounted_returns(rewards_BxT: Array, mask_BxT: Array, gamma: float) -> Array:
  """G_t = r_t + gamma * G_(next policy token), for policy tokens; 0 off the mask.

  Off-mask tokens (environment turns) do not advance the discount but their rewards still flow
  back to earlier policy tokens. Solved as a linear recurrence with an associative scan over T
  (log-depth, no sequential loop over 32K tokens).
  """
  a_BxT = jnp.where(mask_BxT, gamma, 1.0).astype(rewards_BxT.dtype)

  def compose(later, earlier):
    # Maps x -> a x + b; earlier o later = (a_e a_l, a_e b_l + b_e).
    return earlier[0] * later[0], earlier[0] * later[1] + earlier[1]

  _, returns_BxT = jax.lax.associative_scan(compose, (a_BxT, rewards_BxT), reverse=True, axis=1)
  return jnp.where(mask_BxT, returns_BxT, 0.0)


def _reinforce_pp(batch: ScoredBatch, cfg: AdvantageConfig, num_groups: int) -> tuple[Array, Array]:
  del num_groups  # batch-global: no groups
  returns_BxT = discounted_returns(token_rewards(batch, cfg), batch.loss_mask_BxT, cfg.gamma)
  return returns_BxT, returns_BxT


ESTIMATORS: Mapping[AdvantageEstimator, EstimatorFn] = types.MappingProxyType(
  {
    AdvantageEstimator.GRPO: _grpo,
    AdvantageEstimator.RLOO: _rloo,
    AdvantageEstimator.REINFORCE_PP: _reinforce_pp,
  }
)


def compute_advantages(
  batch: ScoredBatch, cfg: AdvantageConfig, *, num_groups: int | None = None
) -> AdvantageBatch:
  """The advantage stage: adds ``advantages_BxT`` and ``returns_BxT`` to a ScoredBatch.

  Jit it with ``cfg`` and ``num_groups`` static (``jax.jit(compute_advantages,
  static_argnames=("cfg", "num_groups"))``) and the batch's shardings as they come from the
  reference stage; it runs wherever the batch lives.

  Args:
    batch: the reference stage's output (any sharding over the batch axis).
    cfg: estimator and its options.
    num_groups: static upper bound on group ids (ids in [0, num_groups)); default B, which always
      suffices. Ids outside the range are not checked on device (see
      ``ScoredBatch.validate_values``) and their rows get wrong statistics.
  """
  batch.validate()
  b = batch.batch_size
  groups = b if num_groups is None else num_groups
  if groups < 1:
    raise ValueError(f"num_groups={num_groups}; allowed: a positive int (default: B={b})")
  if cfg.estimator is AdvantageEstimator.RLOO and num_groups is not None and num_groups >= b:
    raise ValueError(
      f"RLOO needs groups of >= 2 samples, but num_groups={num_groups} >= batch size {b}; "
      "use GRPO/REINFORCE_PP or sample several generations per prompt"
    )
  advantages_BxT, returns_BxT = ESTIMATORS[cfg.estimator](batch, cfg, groups)
  if cfg.whitening:
    advantages_BxT = whiten(advantages_BxT, batch.loss_mask_BxT, cfg.eps)
  return AdvantageBatch.from_scored(
    batch, advantages_BxT.astype(jnp.float32), returns_BxT.astype(jnp.float32)
  )
