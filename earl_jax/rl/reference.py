"""Per-token log-probs of given tokens under a model: the reference stage (and the old policy).

Data flow: RolloutBatch --dispatch--> reference@REFERENCE plan --> ScoredBatch. The update stage
reuses ``token_logps`` (under ``jax.grad``) for the new policy's log-probs.

The logits are computed in chunks over the sequence: only a [B, C, V] block exists at any time,
never the whole [B, T, V] tensor (at 32K context and a 150K vocabulary that tensor alone is
~19 GiB per sequence in f32, the most common long-context OOM in peer systems). Each chunk is
rematerialised in the backward pass for the same reason.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from earl_jax.sampler import sampling


class TokenScores(NamedTuple):
  """Per-token scores of a packed batch, each [B, T] float32 aligned with ``tokens_BxT``."""

  logps_BxT: jax.Array  # log p(tokens[t] | tokens[<t])
  entropy_BxT: jax.Array  # entropy of the distribution token t was drawn from
  expert_logps_BxT: jax.Array | None  # log of the probability of the expert's answers at t


def chunk_logps(
  model: nnx.Module,
  h_BxCxD: jax.Array,
  targets_BxC: jax.Array,
  temperature: float,
  allowed: tuple[int, ...] = (),
  answer_bits_BxC: jax.Array | None = None,
  expert_bits_BxC: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
  """Log-prob of each target and the entropy of the distribution, for one chunk of hidden states;
  with ``expert_bits_BxC``, also the log of the probability mass on the expert's answers."""
  logits_BxCxV = model.project(h_BxCxD).astype(jnp.float32) / temperature
  if allowed:
    logits_BxCxV = sampling.restrict(logits_BxCxV, allowed, answer_bits_BxC)
  logp_BxCxV = jax.nn.log_softmax(logits_BxCxV, axis=-1)
  picked_BxC = jnp.take_along_axis(logp_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
  entropy_BxC = -jnp.sum(jnp.exp(logp_BxCxV) * logp_BxCxV, axis=-1)
  if expert_bits_BxC is None:
    return picked_BxC, entropy_BxC
  # The expert's answers among those the sampler allowed: log sum_{a in expert} p(a). A token
  # without a label (bits 0) keeps the whole alphabet, log 1 = 0, and is masked out by the caller.
  expert_BxC = jax.nn.logsumexp(sampling.restrict(logp_BxCxV, allowed, expert_bits_BxC), axis=-1)
  return picked_BxC, entropy_BxC, expert_BxC


def _shift_left(x_BxT: jax.Array) -> jax.Array:
  """Token t's per-token input where t is predicted: at t - 1 (the wrapped first column is a
  placeholder the result never reads)."""
  return jnp.concatenate([x_BxT[:, 1:], x_BxT[:, :1]], axis=1)


def scores(
  model: nnx.Module,
  tokens_BxT: jax.Array,
  positions_BxT: jax.Array,
  valid_BxT: jax.Array,
  *,
  chunk_size: int,
  temperature: float = 1.0,
  remat: str = "none",
  allowed: tuple[int, ...] = (),
  answer_bits_BxT: jax.Array | None = None,
  expert_bits_BxT: jax.Array | None = None,
) -> TokenScores:
  """log p(tokens[t] | tokens[<t]) and the entropy for every t, aligned with ``tokens_BxT``.

  Sequences are packed (padding only at the end, as in RolloutBatch), so the prediction for token
  t is made at position t-1. Entries at t = 0 and on invalid tokens are 0.

  Args:
    model: an ``earl_jax.model.Decoder``.
    tokens_BxT, positions_BxT, valid_BxT: the packed sequences.
    chunk_size: tokens per logits chunk; T must be a multiple (lengths are bucketed anyway).
    temperature: divide logits by this (match the sampler's to score the behaviour policy).
    remat: the decoder's per-block remat policy ("none" | "full" | "dots").
    allowed: when given, every distribution is restricted to these token ids (the sampler's
      ``Restricted`` strategy); a target outside them gets log-prob -1e30-ish, so only score
      tokens that strategy sampled.
    answer_bits_BxT: with ``allowed``, each token's answer mask (the per-row ``Restricted``
      sampler's ``answer_bits_B`` of the turn it was sampled in; ``RolloutBatch.answer_bits_BxT``):
      token t is scored under the distribution restricted to the answers legal when it was drawn.
    expert_bits_BxT: with ``allowed``, each answer token's expert labels
      (``RolloutBatch.expert_bits_BxT``): ``expert_logps_BxT`` is then log sum p(a) over the
      expert's answers a, under the distribution token t was drawn from (0 where unlabelled).

  Returns:
    ``TokenScores`` in float32 (``expert_logps_BxT`` None without ``expert_bits_BxT``).
  """
  b, t = tokens_BxT.shape
  if t % chunk_size:
    raise ValueError(f"sequence length {t} is not a multiple of chunk_size={chunk_size}")
  if expert_bits_BxT is not None and not allowed:
    raise ValueError("expert_bits_BxT label answers of the allowed alphabet; allowed is empty")
  h_BxTxD, _ = model.hidden(tokens_BxT, positions_BxT, mask_BxT=valid_BxT, remat=remat)
  n = t // chunk_size
  chunks = lambda x_BxT: jnp.moveaxis(x_BxT.reshape(b, n, chunk_size, *x_BxT.shape[2:]), 1, 0)  # noqa: E731
  # Hidden state at t-1 predicts token t: shift the targets left, score, then shift back right.
  targets_BxT = jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros((b, 1), tokens_BxT.dtype)], axis=1)
  bits_NxBxC = None  # token t's answer mask applies where it is predicted: at t - 1, as its target
  if answer_bits_BxT is not None and allowed:
    bits_NxBxC = chunks(_shift_left(answer_bits_BxT))
  expert_NxBxC = None if expert_bits_BxT is None else chunks(_shift_left(expert_bits_BxT))

  # The graph of the model is static; the chunk function closes over it and is rematerialised.
  @jax.checkpoint
  def one_chunk(h_BxCxD, targets_BxC, bits_BxC, expert_BxC) -> tuple[jax.Array, ...]:
    return chunk_logps(model, h_BxCxD, targets_BxC, temperature, allowed, bits_BxC, expert_BxC)

  def body(carry, xs):
    return carry, one_chunk(*xs)

  xs = (chunks(h_BxTxD), chunks(targets_BxT), bits_NxBxC, expert_NxBxC)
  _, outs_NxBxC = jax.lax.scan(body, None, xs)
  # Both the predicted token and the one predicting it must be real.
  scored_BxT = valid_BxT & jnp.concatenate([jnp.zeros((b, 1), bool), valid_BxT[:, :-1]], axis=1)

  def aligned(x_NxBxC: jax.Array) -> jax.Array:
    next_BxT = jnp.moveaxis(x_NxBxC, 0, 1).reshape(b, t)
    x_BxT = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), next_BxT[:, :-1]], axis=1)
    return jnp.where(scored_BxT, x_BxT, 0.0)

  logps_BxT, entropy_BxT, *expert = (aligned(x) for x in outs_NxBxC)
  expert_BxT = jnp.where(expert_bits_BxT > 0, expert[0], 0.0) if expert else None
  return TokenScores(logps_BxT, entropy_BxT, expert_BxT)


def token_logps(
  model: nnx.Module,
  tokens_BxT: jax.Array,
  positions_BxT: jax.Array,
  valid_BxT: jax.Array,
  **kwargs,
) -> tuple[jax.Array, jax.Array]:
  """(logps_BxT, entropy_BxT) of ``scores`` (same arguments, without the expert labels)."""
  if "expert_bits_BxT" in kwargs:
    raise TypeError("token_logps returns no expert log-probs; call scores(expert_bits_BxT=...)")
  out = scores(model, tokens_BxT, positions_BxT, valid_BxT, **kwargs)
  return out.logps_BxT, out.entropy_BxT
