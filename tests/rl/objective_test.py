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


def _expert_batch(b: int = 8):
  """``_batch`` with every policy token an answer of a 4-id alphabet, all legal, and expert labels
  on about half of them (a random non-empty subset of the alphabet)."""
  batch, rng = _batch(b=b), np.random.default_rng(11)
  mask = np.asarray(batch.loss_mask_BxT)
  answers = rng.integers(0, 4, size=mask.shape)
  tokens = np.where(mask, np.asarray(_ALLOWED)[answers], batch.tokens_BxT).astype(np.int32)
  labels = rng.integers(1, 16, size=mask.shape) * (rng.random(mask.shape) < 0.5)
  return batch.replace(
    tokens_BxT=jnp.asarray(tokens),
    expert_bits_BxT=jnp.asarray(np.where(mask, labels, 0), jnp.int32),
  )


_ALLOWED = (3, 7, 19, 30)


@pytest.mark.parametrize("micro", [1, 2, 8])
def test_imitation_term_adds_coef_times_expert_nll_per_policy_token(micro):
  """loss(imitation_coef=c) = loss(0) + c * (-sum over labelled tokens of log pi(expert's
  answers)) / policy tokens, whole or in micro-batches; unlabelled tokens add nothing."""
  batch = _expert_batch()
  cfg = losses.LossConfig(kl_beta=0.05)
  plain = objective.Objective(cfg, chunk_size=8, allowed=_ALLOWED, old_from_new=True)
  imitating = objective.Objective(
    losses.LossConfig(kl_beta=0.05, imitation_coef=0.5), chunk_size=8, allowed=_ALLOWED,
    old_from_new=True,
  )  # fmt: skip
  _, m_plain = _run(plain, batch, num_micro_batches=micro)
  _, m_imit = _run(imitating, batch, num_micro_batches=micro)
  graphdef, state = _state()
  out = reference.scores(
    nnx.merge(graphdef, state.params), batch.tokens_BxT, batch.positions_BxT, batch.valid_BxT,
    chunk_size=8, allowed=_ALLOWED, expert_bits_BxT=batch.expert_bits_BxT,
  )  # fmt: skip
  labelled = np.asarray(batch.loss_mask_BxT) & (np.asarray(batch.expert_bits_BxT) > 0)
  nll = -np.asarray(out.expert_logps_BxT)[labelled].sum() / np.asarray(batch.loss_mask_BxT).sum()
  assert nll > 0.05
  assert float(m_imit["imitation_loss"]) == pytest.approx(nll, rel=1e-5)
  assert float(m_imit["imitation_tokens"]) == labelled.sum()
  assert float(m_imit["loss"]) == pytest.approx(float(m_plain["loss"]) + 0.5 * nll, rel=1e-5)
  assert "imitation_loss" not in m_plain


def test_imitation_gradient_moves_probability_onto_the_experts_answers():
  """With zero advantages and no KL the update is the imitation gradient alone: one small SGD
  step raises log pi(expert's answers) on the labelled tokens, and leaves the rest of the loss 0."""
  batch = _expert_batch()
  batch = batch.replace(advantages_BxT=jnp.zeros_like(batch.advantages_BxT))
  obj = objective.Objective(
    losses.LossConfig(imitation_coef=1.0), chunk_size=8, allowed=_ALLOWED, old_from_new=True
  )
  sgd = optax.apply_if_finite(optax.sgd(0.1), 10)
  graphdef, state = _state(sgd)
  new_state, metrics = _run(obj, batch, sgd)
  assert float(metrics["pg_loss"]) == 0.0 and float(metrics["grad_norm"]) > 0

  def expert_nll(params):
    out = reference.scores(
      nnx.merge(graphdef, params), batch.tokens_BxT, batch.positions_BxT, batch.valid_BxT,
      chunk_size=8, allowed=_ALLOWED, expert_bits_BxT=batch.expert_bits_BxT,
    )  # fmt: skip
    return -float(jnp.sum(out.expert_logps_BxT))

  assert expert_nll(new_state.params) < expert_nll(state.params) - 0.05
