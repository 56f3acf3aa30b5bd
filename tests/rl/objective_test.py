"""The PPO/GRPO objective in the update stage: exact normalisation under micro-batching, the
single-step ratio, and PPO epochs over shuffled mini-batches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.rl import losses, objective, reference, update
from earl_jax.rl.losses import LossAggregation
from tests.rl.update_sharded_test import CFG, _batch

_SGD = optax.apply_if_finite(optax.sgd(1.0), 10)  # params - grads: compares gradients exactly


def _state(optimizer=_SGD):
  graphdef, params = nnx.split(model_lib.Decoder(CFG, rngs=nnx.Rngs(5)))
  return graphdef, update.init_train_state(params, optimizer, jax.random.key(3))


def _run(obj, batch, optimizer=_SGD, **kwargs):
  graphdef, state = _state(optimizer)
  fn = lambda s, b: update.update_step(  # noqa: E731
    graphdef, s, b, loss_fn=obj, totals_fn=obj.totals, optimizer=optimizer, **kwargs
  )
  return jax.jit(fn)(state, batch)


@pytest.mark.parametrize("aggregation", list(LossAggregation))
def test_micro_batching_never_changes_loss_or_gradient(aggregation):
  """Rows of very unequal response lengths (1 to 13 policy tokens): micro-batches of 1, 2 and 4
  rows give the loss and gradient of the whole batch."""
  batch = _batch(b=8)
  assert len(set(np.asarray(batch.loss_mask_BxT).sum(axis=1))) > 3  # unequal lengths
  obj = objective.Objective(losses.LossConfig(aggregation=aggregation, kl_beta=0.05), chunk_size=8)
  full_state, full = _run(obj, batch)
  for micro in (1, 2, 4):
    state, metrics = _run(obj, batch, num_micro_batches=8 // micro)
    for key in ("loss", "grad_norm", "pg_loss", "kl_ref", "ratio_max", "num_tokens"):
      assert float(metrics[key]) == pytest.approx(float(full[key]), rel=1e-6, abs=1e-6), key
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0),
      state.params,
      full_state.params,
    )


def test_single_step_ratio_is_one_and_gradient_is_the_policy_gradient():
  """old_from_new: the batch's old_logps are never read (garbage here) and the gradient equals the
  PPO gradient with pi_old = the current policy scored exactly."""
  batch = _batch(b=8)
  graphdef, state = _state()
  model = nnx.merge(graphdef, state.params)
  current, _ = reference.token_logps(
    model, batch.tokens_BxT, batch.positions_BxT, batch.valid_BxT, chunk_size=8
  )
  cfg = losses.LossConfig(kl_beta=0.05)
  garbage = batch.replace(old_logps_BxT=jnp.full(batch.old_logps_BxT.shape, 7.0))
  exact = batch.replace(old_logps_BxT=jnp.where(batch.loss_mask_BxT, current, 0.0))
  single, m_single = _run(objective.Objective(cfg, chunk_size=8, old_from_new=True), garbage)
  scored, m_scored = _run(objective.Objective(cfg, chunk_size=8), exact)
  assert float(m_single["ratio_max"]) == 1.0 and float(m_single["ratio_min"]) == 1.0
  assert float(m_single["clip_frac"]) == 0.0
  assert float(m_single["loss"]) == pytest.approx(float(m_scored["loss"]), abs=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=0), single.params, scored.params
  )


def test_ppo_epochs_and_mini_batches_are_sequential_optimizer_steps():
  """2 epochs x 2 mini-batches = 4 optimiser steps on the rows of each epoch's permutation."""
  batch = _batch(b=8)
  obj = objective.Objective(losses.LossConfig(), chunk_size=8)
  opt = update.make_optimizer(update.OptimConfig(learning_rate=1e-2))
  state, metrics = _run(obj, batch, opt, num_mini_batches=2, num_epochs=2)
  assert int(state.step) == 4 and np.isfinite(float(metrics["loss"]))

  graphdef, manual = _state(opt)
  step = jax.jit(
    lambda s, b: update.update_step(
      graphdef, s, b, loss_fn=obj, totals_fn=obj.totals, optimizer=opt
    )
  )
  keys = jax.random.split(jax.random.fold_in(manual.rng, manual.step), 2)
  for key in keys:
    order = np.asarray(jax.random.permutation(key, 8))
    for rows in (order[0::2], order[1::2]):  # the strided split of the shuffled batch
      manual, _ = step(manual, jax.tree.map(lambda x, rows=rows: x[rows], batch))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), state.params, manual.params
  )
