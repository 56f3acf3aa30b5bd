"""The RL objective of the update stage: new-policy log-probs (chunked) fed to the policy loss.

Data flow: ``rl/update.update_step`` calls the returned ``loss_fn(model, AdvantageBatch)`` under
``jax.grad`` for each micro-batch. The log-probs are the reference scorer's chunked computation,
so the update stage never materialises the [B, T, V] logits either, and each chunk is recomputed
in the backward pass.
"""

from __future__ import annotations

import jax
from flax import nnx

from earl_jax.rl import losses, reference
from earl_jax.rl.batches import AdvantageBatch


def make_loss_fn(
  loss_cfg: losses.LossConfig, *, chunk_size: int, temperature: float = 1.0, remat: str = "none"
):
  """``(model, batch) -> (loss, metrics)`` for ``update.update_step``.

  ``temperature`` must be the sampler's: the ratio pi_new / pi_old compares distributions at the
  temperature the tokens were sampled at. ``remat`` is the UPDATE plan's per-block policy.
  """

  def loss_fn(model: nnx.Module, batch: AdvantageBatch) -> tuple[jax.Array, dict[str, jax.Array]]:
    new_logps_BxT, entropy_BxT = reference.token_logps(
      model,
      batch.tokens_BxT,
      batch.positions_BxT,
      batch.valid_BxT,
      chunk_size=chunk_size,
      temperature=temperature,
      remat=remat,
    )
    return losses.policy_loss(new_logps_BxT, batch, loss_cfg, entropy_BxT)

  return loss_fn
