"""Per-token log-probs of given tokens under a model: the reference stage (and the old policy).

Data flow: RolloutBatch --dispatch--> reference@REFERENCE plan --> ScoredBatch. The update stage
reuses ``token_logps`` (under ``jax.grad``) for the new policy's log-probs.

The logits are computed in chunks over the sequence: only a [B, C, V] block exists at any time,
never the whole [B, T, V] tensor (at 32K context and a 150K vocabulary that tensor alone is
~19 GiB per sequence in f32, the most common long-context OOM in peer systems). Each chunk is
rematerialised in the backward pass for the same reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from earl_jax.sampler import sampling


def chunk_logps(
  model: nnx.Module,
  h_BxCxD: jax.Array,
  targets_BxC: jax.Array,
  temperature: float,
  allowed: tuple[int, ...] = (),
  answer_bits_BxC: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Log-prob of each target and the entropy of the distribution, for one chunk of hidden states."""
  logits_BxCxV = model.project(h_BxCxD).astype(jnp.float32) / temperature
  if allowed:
    logits_BxCxV = sampling.restrict(logits_BxCxV, allowed, answer_bits_BxC)
  logp_BxCxV = jax.nn.log_softmax(logits_BxCxV, axis=-1)
  picked_BxC = jnp.take_along_axis(logp_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
  entropy_BxC = -jnp.sum(jnp.exp(logp_BxCxV) * logp_BxCxV, axis=-1)
  return picked_BxC, entropy_BxC


def token_logps(
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
) -> tuple[jax.Array, jax.Array]:
  """log p(tokens[t] | tokens[<t]) for every t, aligned with ``tokens_BxT``.

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

  Returns:
    (logps_BxT, entropy_BxT) in float32.
  """
  b, t = tokens_BxT.shape
  if t % chunk_size:
    raise ValueError(f"sequence length {t} is not a multiple of chunk_size={chunk_size}")
  h_BxTxD, _ = model.hidden(tokens_BxT, positions_BxT, mask_BxT=valid_BxT, remat=remat)
  # Hidden state at t-1 predicts token t: shift the targets left, score, then shift back right.
  targets_BxT = jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros((b, 1), tokens_BxT.dtype)], axis=1)
  n = t // chunk_size
  h_NxBxCxD = jnp.moveaxis(h_BxTxD.reshape(b, n, chunk_size, -1), 1, 0)
  targets_NxBxC = jnp.moveaxis(targets_BxT.reshape(b, n, chunk_size), 1, 0)
  bits_NxBxC = None  # token t's answer mask applies where it is predicted: at t - 1, as its target
  if answer_bits_BxT is not None and allowed:
    bits_BxT = jnp.concatenate([answer_bits_BxT[:, 1:], answer_bits_BxT[:, :1]], axis=1)
    bits_NxBxC = jnp.moveaxis(bits_BxT.reshape(b, n, chunk_size), 1, 0)

  # The graph of the model is static; the chunk function closes over it and is rematerialised.
  @jax.checkpoint
  def one_chunk(h_BxCxD, targets_BxC, bits_BxC) -> tuple[jax.Array, jax.Array]:
    return chunk_logps(model, h_BxCxD, targets_BxC, temperature, allowed, bits_BxC)

  def body(carry, xs):
    return carry, one_chunk(*xs)

  xs = (h_NxBxCxD, targets_NxBxC, bits_NxBxC)
  _, (logps_NxBxC, entropy_NxBxC) = jax.lax.scan(body, None, xs)
  next_logps_BxT = jnp.moveaxis(logps_NxBxC, 0, 1).reshape(b, t)
  entropy_BxT = jnp.moveaxis(entropy_NxBxC, 0, 1).reshape(b, t)
  zeros_Bx1 = jnp.zeros((b, 1), jnp.float32)
  logps_BxT = jnp.concatenate([zeros_Bx1, next_logps_BxT[:, :-1]], axis=1)
  entropy_BxT = jnp.concatenate([zeros_Bx1, entropy_BxT[:, :-1]], axis=1)
  # Both the predicted token and the one predicting it must be real.
  scored_BxT = valid_BxT & jnp.concatenate([jnp.zeros((b, 1), bool), valid_BxT[:, :-1]], axis=1)
  return jnp.where(scored_BxT, logps_BxT, 0.0), jnp.where(scored_BxT, entropy_BxT, 0.0)
