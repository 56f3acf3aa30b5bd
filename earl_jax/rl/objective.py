"""The RL objective of the update stage: new-policy log-probs (chunked) fed to the policy loss.

Data flow: ``rl/update.update_step`` calls ``Objective.totals`` once on the whole (mini-)batch and
the objective itself, ``(model, micro, totals) -> (loss, metrics)``, under ``jax.grad`` for each
micro-batch. The log-probs are the reference scorer's chunked computation, so the update stage
never materialises the [B, T, V] logits either, and each chunk is recomputed in the backward pass.

With ``rl.loss.imitation_coef`` > 0 the loss adds an imitation term: on every answer token whose
turn the env's scripted expert labelled (``RolloutBatch.expert_bits_BxT``), -log of the policy's
probability of answering as the expert would (any of its answers). The labels are taken in the
positions the policy itself reached, as in DAgger, not in the expert's own games.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from earl_jax.rl import losses, reference
from earl_jax.rl.batches import AdvantageBatch


@dataclasses.dataclass(frozen=True)
class Objective:
  """PPO/GRPO objective over an ``AdvantageBatch``; hashable, so it can key compiled programs.

  ``temperature`` must be the sampler's: the ratio pi_new / pi_old compares distributions at the
  temperature the tokens were sampled at. ``remat`` is the UPDATE plan's per-block policy.
  ``old_from_new``: the batch gets a single optimiser step, so pi_old is the policy being
  differentiated; the ratio is exp(logp - stop_gradient(logp)) = 1 exactly and the batch's
  ``old_logps_BxT`` is never read (the loop does not compute it).
  ``reference_scored``: the batch's ``ref_logps_BxT`` are real (a KL term needs them); without,
  the ``kl_ref`` metric is left out rather than reported against a placeholder.
  ``allowed``: the sampler's restriction of every answer token to these ids (``Restricted``), so
  the policy differentiated is the one that sampled; with ``per_row``, each answer token among
  the answers its turn allowed (the batch's ``answer_bits_BxT``, ``sampler.legal_answers``).
  ``loss.imitation_coef`` > 0 adds the imitation term (``imitation_loss``) on the answer tokens the
  env's scripted expert labelled (the batch's ``expert_bits_BxT``; needs ``allowed``).
  """

  loss: losses.LossConfig
  chunk_size: int
  temperature: float = 1.0
  remat: str = "none"
  old_from_new: bool = False
  reference_scored: bool = True
  allowed: tuple[int, ...] = ()
  per_row: bool = False

  def totals(self, batch: AdvantageBatch) -> losses.Totals:
    return losses.batch_totals(batch.loss_mask_BxT)

  def __call__(
    self, model: nnx.Module, batch: AdvantageBatch, totals: losses.Totals
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    imitating = self.loss.imitation_coef > 0
    scored = reference.scores(
      model,
      batch.tokens_BxT,
      batch.positions_BxT,
      batch.valid_BxT,
      chunk_size=self.chunk_size,
      temperature=self.temperature,
      remat=self.remat,
      allowed=self.allowed,
      answer_bits_BxT=batch.answer_bits_BxT if self.per_row else None,
      expert_bits_BxT=batch.expert_bits_BxT if imitating else None,
    )
    new_logps_BxT, entropy_BxT = scored.logps_BxT, scored.entropy_BxT
    old_BxT = jax.lax.stop_gradient(new_logps_BxT) if self.old_from_new else None
    loss, metrics = losses.policy_loss(
      new_logps_BxT, batch, self.loss, entropy_BxT, totals=totals, old_logps_BxT=old_BxT
    )
    if not self.reference_scored:
      metrics.pop("kl_ref")
    if imitating:
      imitation, labelled = imitation_loss(scored.expert_logps_BxT, batch, totals)
      loss = loss + self.loss.imitation_coef * imitation
      metrics["imitation_loss"] = jax.lax.stop_gradient(imitation)
      metrics["imitation_tokens"] = labelled
    return loss, metrics


def imitation_loss(
  expert_logps_BxT: jax.Array, batch: AdvantageBatch, totals: losses.Totals
) -> tuple[jax.Array, jax.Array]:
  """(-sum of log pi(expert's answers) over the labelled answer tokens / the batch's policy
  tokens, labelled tokens): these rows' contribution to the whole batch's term, so micro-batch
  parts add up to it exactly, on the same scale as a token-mean policy loss."""
  labelled_BxT = batch.loss_mask_BxT & (batch.expert_bits_BxT > 0)
  nll = -jnp.sum(jnp.where(labelled_BxT, expert_logps_BxT, 0.0))
  return nll / jnp.maximum(totals.tokens, 1.0), jnp.sum(labelled_BxT.astype(jnp.float32))
