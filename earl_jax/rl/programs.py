"""The reference and update stages as compiled programs: the RL functions bound to a plan.

``earl_jax.parallel.executables`` lowers generic programs (a scoring function, a train step) for
a StagePlan without knowing the RL stages; this module supplies the stages' functions. The loop,
the benchmarks and the tests build their programs here.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax
from flax import nnx

from earl_jax.parallel import executables
from earl_jax.parallel.plan import StagePlan
from earl_jax.rl import reference, update


def lower_score(
  plan: StagePlan,
  graphdef: nnx.GraphDef,
  abstract_state: nnx.State,
  bucket: tuple[int, int],
  *,
  chunk_size: int,
  temperature: float = 1.0,
) -> jax.stages.Lowered:
  """The reference program (log-probs of given tokens) for ``bucket`` = (B, T). A plan with a
  micro-batch size runs the rows in waves of that many (a loop inside the program: only one
  wave's activations are live), each wave strided over every data shard."""
  b = bucket[0]
  waves = b // plan.micro_batch_size if plan.micro_batch_size else 1
  if waves * (plan.micro_batch_size or b) != b:
    raise ValueError(f"batch {b} is not divisible by micro_batch_size={plan.micro_batch_size}")

  def score(model, tokens, positions, valid):
    def one(rows):
      return reference.token_logps(model, *rows, chunk_size=chunk_size, temperature=temperature)[0]

    rows = (tokens, positions, valid)
    if waves == 1:
      return one(rows)
    return update.merge_rows(jax.lax.map(one, update.split_rows(rows, waves, "waves")))

  return executables.lower_score(plan, graphdef, abstract_state, bucket, score)


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
