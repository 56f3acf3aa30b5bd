"""Policy losses of the update stage: PPO-clip (asymmetric and dual clip), KL, entropy, aggregation.

Data flow: the update stage computes the new policy's per-token log-probs (and optionally
entropies) for an ``AdvantageBatch`` and calls ``policy_loss`` under ``jax.grad``. Everything
here is a pure, jittable function of [B, T] arrays; ``LossConfig`` is static (hashable).

Objectives, per policy token t (ratio rho_t = pi_new / pi_old, advantage A_t):
  pg_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))            (PPO-clip)
  pg_t = min(pg_t, -c A_t) where A_t < 0                                         (dual clip, c > 1)
  loss_t = pg_t + beta KL_t(pi_new || pi_ref) - entropy_coef H_t
GRPO is this loss with ``kl_beta > 0`` on GRPO advantages (``advantage.AdvantageEstimator.GRPO``);
the REINFORCE++ path instead folds the KL into the reward (``advantage.py``, with the same
``kl.kl_per_token``) and keeps ``kl_beta = 0`` here.
"""

from __future__ import annotations

import dataclasses
import enum

import flax.struct
import jax
import jax.numpy as jnp

from earl_jax.rl.batches import AdvantageBatch
from earl_jax.rl.kl import KLEstimator, kl_per_token
from earl_jax.types import Array, ConfigError


class LossAggregation(enum.Enum):
  """How per-token losses become one scalar (masked tokens never count)."""

  TOKEN_MEAN = "token_mean"  # sum over all policy tokens / number of policy tokens
  SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"  # mean over rows of each row's token mean
  SEQ_SUM_NORM = "seq_sum_norm"  # sum over all policy tokens / (B * constant), Dr. GRPO


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static configuration of ``policy_loss`` (paper symbols in the comments)."""

  clip_eps_low: float = 0.2  # epsilon_low: ratio clipped below at 1 - clip_eps_low
  clip_eps_high: float = 0.2  # epsilon_high: ratio clipped above at 1 + clip_eps_high (0.28 =
  # DAPO's "clip-higher")
  dual_clip: float | None = None  # c > 1: bounds the loss of negative-advantage tokens by -c*A
  kl_beta: float = 0.0  # beta: weight of KL(pi_new || pi_ref) in the loss (GRPO); 0 = no term
  kl_estimator: KLEstimator = KLEstimator.K3  # estimator of that in-loss KL
  entropy_coef: float = 0.0  # weight of the entropy bonus (needs entropy_BxT from the caller)
  aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
  seq_sum_norm: int | None = None  # SEQ_SUM_NORM's constant (e.g. max generation length);
  # None = the padded length T, which changes with the length bucket
  # Weight of the imitation term: -log pi(expert's answers) summed over the answer tokens the env's
  # scripted expert labelled (RolloutBatch.expert_bits_BxT), per policy token (rl/objective.py).
  imitation_coef: float = 0.0

  def __post_init__(self):
    for key in ("clip_eps_low", "clip_eps_high"):
      value = getattr(self, key)
      if not isinstance(value, float | int) or not 0.0 <= value < 1.0:
        raise ConfigError(key, value, "a float in [0, 1)")
    if self.dual_clip is not None and not self.dual_clip > 1.0:
      raise ConfigError("dual_clip", self.dual_clip, "None (off) or a float > 1")
    for key in ("kl_beta", "entropy_coef", "imitation_coef"):
      value = getattr(self, key)
      if not value >= 0.0:
        raise ConfigError(key, value, "a non-negative float")
    if not isinstance(self.kl_estimator, KLEstimator):
      raise ConfigError("kl_estimator", self.kl_estimator, f"one of {list(KLEstimator)}")
    if not isinstance(self.aggregation, LossAggregation):
      raise ConfigError("aggregation", self.aggregation, f"one of {list(LossAggregation)}")
    if self.seq_sum_norm is not None and not self.seq_sum_norm > 0:
      raise ConfigError("seq_sum_norm", self.seq_sum_norm, "None (= padded T) or a positive int")


@flax.struct.dataclass
class Totals:
  """Normalisers of one batch, computed once on the whole (mini-)batch before it is split into
  micro-batches, so every micro-batch's loss is a partial sum of the batch loss (exactness)."""

  tokens: Array  # policy tokens in the batch
  rows_with_tokens: Array  # rows holding at least one policy token
  rows: int = flax.struct.field(pytree_node=False)  # rows in the batch (static)


def batch_totals(mask_BxT: Array) -> Totals:
  m_BxT = mask_BxT.astype(jnp.float32)
  return Totals(
    tokens=jnp.sum(m_BxT),
    rows_with_tokens=jnp.sum((jnp.sum(m_BxT, axis=1) > 0).astype(jnp.float32)),
    rows=mask_BxT.shape[0],
  )


def aggregate(
  loss_BxT: Array,
  mask_BxT: Array,
  mode: LossAggregation,
  seq_sum_norm: int | None = None,
  totals: Totals | None = None,
) -> Array:
  """Reduces per-token losses to a scalar; masked-out tokens never contribute.

  With ``totals`` of a larger batch that these rows are part of, the result is these rows'
  contribution to that batch's aggregate (contributions of disjoint parts add up to it exactly);
  without, ``totals`` are these rows' own. TOKEN_MEAN: sum / policy tokens. SEQ_MEAN_TOKEN_MEAN:
  sum of row token-means / rows with policy tokens (rows without are left out). SEQ_SUM_NORM:
  sum / (rows * seq_sum_norm), default rows * T, independent of response lengths (Dr. GRPO).
  Empty batches give 0.
  """
  totals = batch_totals(mask_BxT) if totals is None else totals
  m_BxT = mask_BxT.astype(loss_BxT.dtype)
  masked_BxT = jnp.where(mask_BxT, loss_BxT, 0.0)
  if mode is LossAggregation.TOKEN_MEAN:
    return jnp.sum(masked_BxT) / jnp.maximum(totals.tokens, 1.0)
  if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
    row_mean_B = jnp.sum(masked_BxT, axis=1) / jnp.maximum(jnp.sum(m_BxT, axis=1), 1.0)
    return jnp.sum(row_mean_B) / jnp.maximum(totals.rows_with_tokens, 1.0)
  if mode is LossAggregation.SEQ_SUM_NORM:
    norm = loss_BxT.shape[1] if seq_sum_norm is None else seq_sum_norm
    return jnp.sum(masked_BxT) / float(totals.rows * norm)
  raise ValueError(f"aggregation {mode!r}; allowed: {[m.name for m in LossAggregation]}")


def ppo_clip_per_token(
  new_logps_BxT: Array,
  old_logps_BxT: Array,
  advantages_BxT: Array,
  mask_BxT: Array,
  cfg: LossConfig,
) -> tuple[Array, Array, Array, Array]:
  """Per-token PPO-clip loss (with clip-higher and dual clip) and its diagnostics.

  Returns:
    (pg_loss_BxT, ratio_BxT, clipped_BxT, dual_clipped_BxT): the loss (0 off the mask), the
    ratio pi_new / pi_old (1 off the mask), and bool masks of the tokens whose loss is the clipped
    branch (the gradient through the ratio is zero there) or the dual-clip bound.
  """
  # Off-mask log-probs may be garbage: zero the log-ratio there so exp() stays finite and no NaN
  # leaks into the gradient through jnp.where.
  log_ratio_BxT = jnp.where(mask_BxT, new_logps_BxT - old_logps_BxT, 0.0)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  unclipped_BxT = -advantages_BxT * ratio_BxT
  clipped_ratio_BxT = jnp.clip(ratio_BxT, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
  clipped_loss_BxT = -advantages_BxT * clipped_ratio_BxT
  pg_BxT = jnp.maximum(unclipped_BxT, clipped_loss_BxT)
  clipped_BxT = mask_BxT & (clipped_loss_BxT > unclipped_BxT)
  if cfg.dual_clip is None:
    dual_clipped_BxT = jnp.zeros_like(mask_BxT)
  else:
    bound_BxT = -cfg.dual_clip * advantages_BxT
    dual_clipped_BxT = mask_BxT & (advantages_BxT < 0) & (pg_BxT > bound_BxT)
    pg_BxT = jnp.where(advantages_BxT < 0, jnp.minimum(pg_BxT, bound_BxT), pg_BxT)
  return jnp.where(mask_BxT, pg_BxT, 0.0), ratio_BxT, clipped_BxT, dual_clipped_BxT


def _masked_mean(x_BxT: Array, mask_BxT: Array, tokens: Array) -> Array:
  """Token mean over a batch of ``tokens`` policy tokens (these rows' contribution to it)."""
  return jnp.sum(jnp.where(mask_BxT, x_BxT, 0.0)) / jnp.maximum(tokens, 1.0)


def _masked_extreme(x_BxT: Array, mask_BxT: Array, fn, fill: float, partial: bool) -> Array:
  # fn over the masked entries. An empty mask gives 0, or, for a part of a larger batch, the
  # neutral +-inf so that max/min over the parts is right (the update stage maps +-inf to 0).
  value = fn(jnp.where(mask_BxT, x_BxT, fill))
  return value if partial else jnp.where(jnp.any(mask_BxT), value, 0.0)


def policy_loss(
  new_logps_BxT: Array,
  batch: AdvantageBatch,
  cfg: LossConfig,
  entropy_BxT: Array | None = None,
  *,
  totals: Totals | None = None,
  old_logps_BxT: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """The update stage's loss: PPO-clip + optional in-loss KL + optional entropy bonus.

  Args:
    new_logps_BxT: f32 [B, T] log-probs of ``batch.tokens_BxT`` under the policy being trained
      (differentiate w.r.t. these); only entries on ``batch.loss_mask_BxT`` are read.
    batch: supplies old_logps, ref_logps, advantages and the loss mask.
    cfg: static loss configuration.
    entropy_BxT: f32 [B, T] per-token entropy of the new policy; required iff entropy_coef > 0
      (always reported as a metric when given).
    totals: normalisers of the whole batch these rows belong to (``batch_totals``); loss and
      metrics are then these rows' contributions (see ``aggregate``). None: these rows alone.
    old_logps_BxT: overrides ``batch.old_logps_BxT`` (the single-step objective passes
      stop_gradient(new_logps_BxT): the ratio is exactly 1 and its gradient the policy gradient).

  Returns:
    (loss, metrics). Metrics are token means over policy tokens (independent of the loss
    aggregation), computed without gradient: pg_loss, kl_loss (the KL term, 0 if kl_beta == 0),
    kl_ref (KL(new || ref) by cfg.kl_estimator), approx_kl_old (k3 estimate of KL(old || new)
    on the sampled tokens: how far the updates since rollout moved the policy), clip_frac,
    dual_clip_frac, ratio_mean, ratio_max, ratio_min, entropy (if given), num_tokens.
  """
  if cfg.entropy_coef > 0 and entropy_BxT is None:
    raise ValueError(f"LossConfig.entropy_coef={cfg.entropy_coef} > 0 needs entropy_BxT")
  mask_BxT = batch.loss_mask_BxT
  partial = totals is not None
  totals = batch_totals(mask_BxT) if totals is None else totals
  old_BxT = batch.old_logps_BxT if old_logps_BxT is None else old_logps_BxT
  pg_BxT, ratio_BxT, clipped_BxT, dual_BxT = ppo_clip_per_token(
    new_logps_BxT, old_BxT, batch.advantages_BxT, mask_BxT, cfg
  )
  loss_BxT = pg_BxT
  kl_ref_BxT = kl_per_token(new_logps_BxT, batch.ref_logps_BxT, mask_BxT, cfg.kl_estimator)
  if cfg.kl_beta > 0:
    loss_BxT = loss_BxT + cfg.kl_beta * kl_ref_BxT
  if cfg.entropy_coef > 0:
    loss_BxT = loss_BxT - cfg.entropy_coef * entropy_BxT
  loss = aggregate(loss_BxT, mask_BxT, cfg.aggregation, cfg.seq_sum_norm, totals)

  parts = {"pg": pg_BxT, "ratio": ratio_BxT, "clipped": clipped_BxT, "dual": dual_BxT}
  parts.update(kl_ref=kl_ref_BxT, old=old_BxT, new=new_logps_BxT, entropy=entropy_BxT)
  return loss, _loss_metrics(parts, mask_BxT, totals, cfg.kl_beta, partial)


def _loss_metrics(
  parts: dict[str, Array | None], mask_BxT: Array, totals: Totals, kl_beta: float, partial: bool
) -> dict[str, Array]:
  """``policy_loss``'s metrics: token means over policy tokens, without gradient."""
  sg = jax.lax.stop_gradient
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  # k3 with the roles of ref played by new: KL(old || new) estimated on samples of old.
  approx_kl_old_BxT = kl_per_token(sg(parts["old"]), parts["new"], mask_BxT, KLEstimator.K3)
  mean = lambda x_BxT: _masked_mean(x_BxT, mask_BxT, totals.tokens)  # noqa: E731
  ratio_BxT = sg(parts["ratio"])
  metrics = {
    "pg_loss": mean(sg(parts["pg"])),
    "kl_loss": kl_beta * mean(sg(parts["kl_ref"])),
    "kl_ref": mean(sg(parts["kl_ref"])),
    "approx_kl_old": mean(sg(approx_kl_old_BxT)),
    "clip_frac": mean(f32(parts["clipped"])),
    "dual_clip_frac": mean(f32(parts["dual"])),
    "ratio_mean": mean(ratio_BxT),
    "ratio_max": _masked_extreme(ratio_BxT, mask_BxT, jnp.max, -jnp.inf, partial),
    "ratio_min": _masked_extreme(ratio_BxT, mask_BxT, jnp.min, jnp.inf, partial),
    "num_tokens": jnp.sum(f32(mask_BxT)),
  }
  if parts["entropy"] is not None:
    metrics["entropy"] = mean(sg(parts["entropy"]))
  return metrics
