"""The reference and update stages as compiled programs: the RL functions bound to a plan.

``earl_jax.parallel.executables`` lowers generic programs (a scoring function, a train step) for
a StagePlan without knowing the RL stages; this module supplies the stages' functions. The loop,
the benchmarks and the tests build their programs here.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from earl_jax import config_lib
from earl_jax.parallel import executables
from earl_jax.parallel.plan import StagePlan
from earl_jax.rl import batches, objective, reference, update
from earl_jax.sampler import engine
from earl_jax.types import Stage


def lower_score(
  plan: StagePlan,
  graphdef: nnx.GraphDef,
  abstract_state: nnx.State,
  bucket: tuple[int, int],
  *,
  chunk_size: int,
  temperature: float = 1.0,
  allowed: tuple[int, ...] = (),
  answer_bits: bool = False,
) -> jax.stages.Lowered:
  """The reference program (log-probs of given tokens) for ``bucket`` = (B, T). A plan with a
  micro-batch size runs the rows in waves of that many (a loop inside the program: only one
  wave's activations are live), each wave strided over every data shard. ``allowed``: the
  sampler's answer restriction (``sampling.Restricted``), scored the same way; with
  ``answer_bits`` the program takes a 4th row array, the batch's ``answer_bits_BxT``."""
  b = bucket[0]
  waves = b // plan.micro_batch_size if plan.micro_batch_size else 1
  if waves * (plan.micro_batch_size or b) != b:
    raise ValueError(f"batch {b} is not divisible by micro_batch_size={plan.micro_batch_size}")

  if answer_bits and not allowed:
    raise ValueError("answer_bits needs the allowed answer ids they index")

  def score(model, *rows):
    def one(rows):
      tokens, positions, valid, *bits = rows
      return reference.token_logps(
        model,
        tokens,
        positions,
        valid,
        chunk_size=chunk_size,
        temperature=temperature,
        allowed=allowed,
        answer_bits_BxT=bits[0] if bits else None,
      )[0]

    if waves == 1:
      return one(rows)
    return update.merge_rows(jax.lax.map(one, update.split_rows(rows, waves, "waves")))

  dtypes = (jnp.int32, jnp.int32, jnp.bool_) + ((jnp.int32,) if answer_bits else ())
  return executables.lower_score(plan, graphdef, abstract_state, bucket, score, dtypes)


def lower_update(
  plan: StagePlan,
  graphdef: nnx.GraphDef,
  abstract_train_state: update.TrainState,
  abstract_batch: Any,
  *,
  loss_fn: update.LossFn,
  optimizer: optax.GradientTransformation,
  totals_fn: update.TotalsFn = update.no_totals,
  num_mini_batches: int = 1,
  num_epochs: int = 1,
) -> jax.stages.Lowered:
  """The update program (``num_epochs x num_mini_batches`` optimiser steps); the train state is
  donated. ``abstract_batch`` leaves are [B, ...]; the plan's micro-batch splits a mini-batch."""
  b = jax.tree.leaves(abstract_batch)[0].shape[0]
  if b % num_mini_batches:
    raise ValueError(f"batch {b} is not divisible by num_mini_batches={num_mini_batches}")
  mini = b // num_mini_batches
  micro = plan.micro_batch_size or mini  # 0 means the whole mini-batch in one step
  if mini % micro:
    raise ValueError(
      f"mini-batch {mini} (batch {b} / {num_mini_batches}) is not divisible by "
      f"micro_batch_size={plan.micro_batch_size}"
    )
  step = functools.partial(
    update.update_step,
    graphdef,
    loss_fn=loss_fn,
    optimizer=optimizer,
    totals_fn=totals_fn,
    num_micro_batches=mini // micro,
    num_mini_batches=num_mini_batches,
    num_epochs=num_epochs,
  )
  return executables.lower_train_step(plan, abstract_train_state, abstract_batch, step, optimizer)


def abstract_update_batch(b: int, t: int) -> batches.AdvantageBatch:
  """The update stage's input for ``b`` sequences of ``t`` tokens, as shapes and dtypes."""

  def make():
    f, i, m = (jnp.zeros((b, t), d) for d in (jnp.float32, jnp.int32, jnp.bool_))
    rb = batches.RolloutBatch.create(
      tokens_BxT=i,
      positions_BxT=i,
      valid_BxT=m,
      loss_mask_BxT=m,
      sampler_logps_BxT=f,
      rewards_B=jnp.zeros((b,), jnp.float32),
      group_ids_B=jnp.zeros((b,), jnp.int32),
    )
    scored = batches.ScoredBatch.from_rollout(rb, ref_logps_BxT=f, old_logps_BxT=f)
    return batches.AdvantageBatch.from_scored(scored, advantages_BxT=f, returns_BxT=f)

  return jax.eval_shape(make)


class StagePrograms:
  """One run's three stage programs, lowered from abstract shapes (nothing is allocated) and
  compiled once per (stage, plan, program shape) into ``cache``. ``rl/stages.py`` runs them; the
  pod fit check (``earl_jax/fit.py``) compiles them for devices it does not have.
  ``answer_ids``: the token ids every answer token is restricted to (``RunSetup.answer_ids``;
  empty when the run does not restrict answers), scored like the sampler samples them; under
  ``sampler.legal_answers`` each answer token is scored among the answers legal on its turn."""

  def __init__(
    self,
    cfg: config_lib.ExperimentConfig,
    graphdef: nnx.GraphDef,
    abstract_params: nnx.State,
    abstract_state: update.TrainState,
    optimizer: optax.GradientTransformation,
    answer_ids: tuple[int, ...] = (),
  ) -> None:
    self.cfg, self.graphdef, self.optimizer = cfg, graphdef, optimizer
    self.answer_ids = tuple(answer_ids)
    self.abstract_params, self.abstract_state = abstract_params, abstract_state
    self.cache = executables.ExecutableCache()

  def rollout(self, plan: StagePlan, spec: engine.GenerationSpec, bucket, cache_len: int):
    """The decode program for ``bucket`` = (slots, prompt chunk) with a ``cache_len`` cache."""
    lower = lambda: executables.lower_generate(  # noqa: E731
      plan, self.graphdef, self.abstract_params, cache_len, spec, bucket
    )
    return self.cache.get(Stage.ROLLOUT, plan, (*bucket, cache_len), lower, extra=spec)

  def score(self, plan: StagePlan, bucket: tuple[int, int]):
    """The reference program for ``bucket`` = (B, T)."""
    lower = lambda: lower_score(  # noqa: E731
      plan,
      self.graphdef,
      self.abstract_params,
      bucket,
      chunk_size=self.cfg.rl.logp_chunk,
      temperature=self.cfg.sampler.temperature,
      allowed=self.answer_ids,
      answer_bits=self.cfg.sampler.legal_answers,
    )
    return self.cache.get(Stage.REFERENCE, plan, bucket, lower)

  def update(self, plan: StagePlan, abstract_batch: batches.AdvantageBatch):
    """The update program (every optimiser step of one rollout batch) for ``abstract_batch``."""
    rl = self.cfg.rl
    loss_fn = objective.Objective(
      rl.loss,
      chunk_size=rl.logp_chunk,
      temperature=self.cfg.sampler.temperature,
      remat=plan.remat,
      old_from_new=rl.optimizer_steps == 1,
      reference_scored=rl.needs_ref_logps,
      allowed=self.answer_ids,
      per_row=self.cfg.sampler.legal_answers,
    )
    lower = lambda: lower_update(  # noqa: E731
      plan,
      self.graphdef,
      self.abstract_state,
      abstract_batch,
      loss_fn=loss_fn,
      optimizer=self.optimizer,
      totals_fn=loss_fn.totals,
      num_mini_batches=rl.mini_batches,
      num_epochs=rl.ppo_epochs,
    )
    return self.cache.get(Stage.UPDATE, plan, abstract_batch.tokens_BxT.shape, lower)
