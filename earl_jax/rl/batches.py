"""Stage contracts: the immutable batch types that flow between the stages of one RL step.

Data flow (DESIGN.md): rollout -> ``RolloutBatch`` -> reference -> ``ScoredBatch`` -> advantage ->
``AdvantageBatch`` -> update. Each type is a ``flax.struct`` dataclass (a pytree, so it passes
through ``jax.jit`` and the dispatcher whole) and extends the previous one with the fields its
stage adds, so a function written for a ``ScoredBatch`` also accepts an ``AdvantageBatch``. Stages
build the next type with ``from_rollout`` / ``from_scored``; no stage copies fields by hand.

Layout rules shared by every field:
  * Sequences are right-padded to a common (bucketed) length T; ``valid_BxT`` marks real tokens.
  * Per-token quantities that only exist for policy-sampled tokens (log-probs, advantages) are 0
    wherever ``loss_mask_BxT`` is False.
  * The field-name suffix is the shape (``_B``: [B], ``_BxT``: [B, T]); ``logical_axes()`` derives
    the logical sharding axes from it, so a new field needs no extra sharding code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self

import flax.struct
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from earl_jax.types import BATCH, SEQ, Array

# Shape letter -> logical axis, for the suffixes used by batch fields.
_LETTER_AXES = {"B": BATCH, "T": SEQ}

# Required dtype of every field, by name; validate() checks these.
_DTYPES: dict[str, np.dtype] = {
  "tokens_BxT": np.dtype(np.int32),
  "positions_BxT": np.dtype(np.int32),
  "valid_BxT": np.dtype(np.bool_),
  "loss_mask_BxT": np.dtype(np.bool_),
  "sampler_logps_BxT": np.dtype(np.float32),
  "rewards_B": np.dtype(np.float32),
  "group_ids_B": np.dtype(np.int32),
  "token_rewards_BxT": np.dtype(np.float32),
  "answer_bits_BxT": np.dtype(np.int32),
  "expert_bits_BxT": np.dtype(np.int32),
  "ref_logps_BxT": np.dtype(np.float32),
  "old_logps_BxT": np.dtype(np.float32),
  "advantages_BxT": np.dtype(np.float32),
  "returns_BxT": np.dtype(np.float32),
}


def _shape_letters(name: str) -> tuple[str, ...]:
  """``"rewards_B"`` -> ("B",); ``"tokens_BxT"`` -> ("B", "T")."""
  suffix = name.rsplit("_", 1)[-1]
  letters = tuple(suffix.split("x"))
  unknown = [c for c in letters if c not in _LETTER_AXES]
  if unknown:
    raise ValueError(
      f"batch field '{name}' has shape suffix '{suffix}' with unknown letters {unknown}; "
      f"allowed letters: {sorted(_LETTER_AXES)}"
    )
  return letters


class _BatchMixin:
  """Shared helpers: logical axes, field access and shape/dtype validation."""

  @classmethod
  def logical_axes(cls) -> Self:
    """An instance of ``cls`` whose every field is a PartitionSpec of *logical* axis names.

    It has the pytree structure of a batch, so the dispatcher maps it to mesh shardings with the
    stage's rules and zips it with a batch (``jax.tree.map(f, batch, cls.logical_axes())``).
    """
    specs = {
      f.name: PartitionSpec(*(_LETTER_AXES[c] for c in _shape_letters(f.name)))
      for f in dataclasses.fields(cls)
    }
    return cls(**specs)

  def field_dict(self) -> dict[str, Any]:
    """The fields as a shallow dict (no copies): what ``from_*`` constructors extend."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @property
  def batch_size(self) -> int:
    return int(self.tokens_BxT.shape[0])

  @property
  def seq_len(self) -> int:
    return int(self.tokens_BxT.shape[1])

  def validate(self) -> Self:
    """Checks every field's rank, [B, T] dims and dtype; raises ValueError naming the field.

    Only static information is read, so it works on numpy arrays, jax arrays and tracers alike
    (call it at the top of a jitted stage). Returns ``self`` to allow chaining.
    """
    if np.ndim(self.tokens_BxT) != 2:
      raise ValueError(
        f"{type(self).__name__}.tokens_BxT must have shape [B, T]; got {np.shape(self.tokens_BxT)}"
      )
    b, t = np.shape(self.tokens_BxT)
    dims = {"B": b, "T": t}
    for name, value in self.field_dict().items():
      letters = _shape_letters(name)
      want_shape = tuple(dims[c] for c in letters)
      got_shape = tuple(np.shape(value))
      if got_shape != want_shape:
        raise ValueError(
          f"{type(self).__name__}.{name} has shape {got_shape}; expected {want_shape} "
          f"([{', '.join(letters)}] with B={b}, T={t} taken from tokens_BxT)"
        )
      got_dtype = np.dtype(value.dtype)
      if got_dtype != _DTYPES[name]:
        raise ValueError(
          f"{type(self).__name__}.{name} has dtype {got_dtype}; expected {_DTYPES[name]}"
        )
    return self

  def validate_values(self, num_groups: int | None = None) -> Self:
    """Host-side value checks (reads the arrays; use in tests and debugging, not in jit).

    Checks that ``loss_mask`` implies ``valid`` and that group ids lie in [0, num_groups)
    (num_groups defaults to B, the most groups a batch can hold).
    """
    valid_BxT = np.asarray(self.valid_BxT)
    loss_mask_BxT = np.asarray(self.loss_mask_BxT)
    if np.any(loss_mask_BxT & ~valid_BxT):
      rows = np.nonzero(np.any(loss_mask_BxT & ~valid_BxT, axis=1))[0].tolist()
      raise ValueError(f"loss_mask_BxT is True on padding (valid_BxT False) in rows {rows}")
    limit = self.batch_size if num_groups is None else num_groups
    group_ids_B = np.asarray(self.group_ids_B)
    bad = group_ids_B[(group_ids_B < 0) | (group_ids_B >= limit)]
    if bad.size:
      raise ValueError(f"group_ids_B has values {sorted(set(bad.tolist()))}; allowed: [0, {limit})")
    return self


@flax.struct.dataclass(kw_only=True)
class RolloutBatch(_BatchMixin):
  """What the rollout stage produces: B episodes, each prompt + all turns in one row.

  Fields:
    tokens_BxT: int32 [B, T]. Prompt, model turns and environment turns, right-padded.
    positions_BxT: int32 [B, T]. Position ids of the tokens (0.. on real tokens, 0 on padding).
    valid_BxT: bool [B, T]. True on real tokens, False on padding.
    loss_mask_BxT: bool [B, T]. True on tokens the policy sampled; prompt, environment and padding
      tokens are False. Implies ``valid_BxT``.
    sampler_logps_BxT: f32 [B, T]. Log-prob of each sampled token under the sampling distribution
      (the rollout engine's, incl. its temperature / top-k / top-p); 0 where loss_mask is False.
    rewards_B: f32 [B]. Episode return (the sum of all turn rewards).
    group_ids_B: int32 [B]. Samples of one prompt / initial state share an id; ids in
      [0, num_groups). Group statistics (GRPO, RLOO) are taken over rows with the same id.
    token_rewards_BxT: f32 [B, T]. Per-turn rewards, each on the last token of its model turn
      (sums to ``rewards_B`` per row); all zeros when the environment gives only a final reward.
    answer_bits_BxT: int32 [B, T]. On a token sampled under ``sampler.legal_answers``, the mask of
      the answers that were legal (bit j: the j-th answer of the env's alphabet); the scorer
      restricts that token's distribution to them, as the sampler did. -1 (every bit) elsewhere.
    expert_bits_BxT: int32 [B, T]. On an answer token of a turn where the env's scripted expert
      had an opinion (``env.expert_answer_bits()``, recorded while ``rl.loss.imitation_coef`` > 0
      and within ``rl.imitation_steps``), the mask of the answers it would have given: the labels
      of the imitation term. 0 (no label) elsewhere.
  """

  tokens_BxT: Array
  positions_BxT: Array
  valid_BxT: Array
  loss_mask_BxT: Array
  sampler_logps_BxT: Array
  rewards_B: Array
  group_ids_B: Array
  token_rewards_BxT: Array
  answer_bits_BxT: Array
  expert_bits_BxT: Array

  @classmethod
  def create(
    cls,
    *,
    token_rewards_BxT: Array | None = None,
    answer_bits_BxT: Array | None = None,
    expert_bits_BxT: Array | None = None,
    **fields: Array,
  ) -> RolloutBatch:
    """Builds a batch; ``token_rewards_BxT=None`` means no per-turn rewards (zeros),
    ``answer_bits_BxT=None`` no per-turn answer masks (-1), ``expert_bits_BxT=None`` no expert
    labels (0)."""
    shape = np.shape(fields["tokens_BxT"])
    if token_rewards_BxT is None:
      token_rewards_BxT = jnp.zeros(shape, jnp.float32)
    if answer_bits_BxT is None:
      answer_bits_BxT = jnp.full(shape, -1, jnp.int32)
    if expert_bits_BxT is None:
      expert_bits_BxT = jnp.zeros(shape, jnp.int32)
    return cls(
      token_rewards_BxT=token_rewards_BxT,
      answer_bits_BxT=answer_bits_BxT,
      expert_bits_BxT=expert_bits_BxT,
      **fields,
    )


@flax.struct.dataclass(kw_only=True)
class ScoredBatch(RolloutBatch):
  """RolloutBatch + the reference stage's log-probs (both aligned with ``tokens_BxT``).

  Fields (in addition to RolloutBatch's):
    ref_logps_BxT: f32 [B, T]. log pi_ref(token_t | tokens_<t) under the frozen reference;
      0 where loss_mask is False.
    old_logps_BxT: f32 [B, T]. The same under the policy parameters that generated the batch
      (pi_old of the PPO ratio), recomputed by the training model; 0 where loss_mask is False.
  """

  ref_logps_BxT: Array
  old_logps_BxT: Array

  @classmethod
  def from_rollout(cls, rb: RolloutBatch, ref_logps_BxT: Array, old_logps_BxT: Array) -> Self:
    return cls(**rb.field_dict(), ref_logps_BxT=ref_logps_BxT, old_logps_BxT=old_logps_BxT)


@flax.struct.dataclass(kw_only=True)
class AdvantageBatch(ScoredBatch):
  """ScoredBatch + advantages: the update stage's input.

  Fields (in addition to ScoredBatch's):
    advantages_BxT: f32 [B, T]. Token-level advantage; sequence-level estimators (GRPO, RLOO)
      broadcast each row's value over its loss mask. 0 where loss_mask is False.
    returns_BxT: f32 [B, T]. The (discounted) return-to-go each advantage was built from, before
      any baseline or whitening: REINFORCE++'s KL-shaped token returns, or the episode reward
      broadcast over the loss mask for sequence-level estimators. 0 where loss_mask is False.
  """

  advantages_BxT: Array
  returns_BxT: Array

  @classmethod
  def from_scored(cls, sb: ScoredBatch, advantages_BxT: Array, returns_BxT: Array) -> Self:
    return cls(**sb.field_dict(), advantages_BxT=advantages_BxT, returns_BxT=returns_BxT)
