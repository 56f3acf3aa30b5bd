"""The policy-update stage: train state and the optimiser steps of one rollout batch.

Data flow: AdvantageBatch --dispatch--> update@UPDATE plan --> new TrainState (params then go back
to the rollout layout by weight sync). The loss itself is injected (``loss_fn`` + ``totals_fn``)
so the update stage does not depend on a particular RL objective; ``rl/objective.py`` builds the
PPO/GRPO one.

One call runs ``num_epochs x num_mini_batches`` optimiser steps (PPO epochs over shuffled
mini-batches; 1 x 1 is the common GRPO setting), each accumulating gradients over micro-batches.

Exact normalisation: ``totals_fn`` reads the whole (mini-)batch once (e.g. its policy-token
count) and ``loss_fn(model, micro, totals)`` returns that micro-batch's *contribution* to the
batch loss, already divided by the batch totals. Contributions are summed, so micro-batching
never changes the loss or the gradient. Metrics follow the same rule (partial sums), except those
named ``*_max`` / ``*_min``, combined by max / min (+-inf, nothing seen, is reported as 0).

Precision: gradients are taken w.r.t. the master parameters (float32 by default, whatever the
compute dtype) and accumulated in float32 across micro-batches even for bf16 parameters.

Optimiser: AdamW with linear warmup + cosine decay, global-norm clipping, and optax's
``apply_if_finite`` guard, which turns an update whose gradients are not finite into a no-op and
counts it (``skipped_updates`` in the metrics) instead of writing NaNs into the parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from earl_jax.types import ConfigError

# (model, micro-batch, totals of the whole batch) -> (loss contribution, metric contributions)
LossFn = Callable[[nnx.Module, Any, Any], tuple[jax.Array, dict[str, jax.Array]]]
TotalsFn = Callable[[Any], Any]


def no_totals(batch: Any) -> None:
  """For losses that need nothing from the whole batch (their contributions just add up)."""
  del batch


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 1e-5  # peak learning rate
  warmup_steps: int = 0  # linear warmup from 0 to learning_rate
  decay_steps: int = 1000  # cosine decay length after warmup (total schedule = warmup + decay)
  end_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
  weight_decay: float = 0.0  # decoupled AdamW weight decay
  b1: float = 0.9  # Adam beta1
  b2: float = 0.999  # Adam beta2
  eps: float = 1e-8  # Adam epsilon
  max_grad_norm: float = 1.0  # global-norm clipping threshold; 0 disables clipping

  def __post_init__(self):
    _positive = {
      "learning_rate": self.learning_rate,
      "decay_steps": self.decay_steps,
      "eps": self.eps,
    }
    for key, value in _positive.items():
      if not value > 0:
        raise ConfigError(key, value, "a positive number")
    for key, value in (("warmup_steps", self.warmup_steps), ("weight_decay", self.weight_decay)):
      if value < 0:
        raise ConfigError(key, value, "a non-negative number")
    if self.max_grad_norm < 0:
      raise ConfigError("max_grad_norm", self.max_grad_norm, "a non-negative float (0 = off)")
    if not 0.0 <= self.end_lr_ratio <= 1.0:
      raise ConfigError("end_lr_ratio", self.end_lr_ratio, "a float in [0, 1]")
    for key, value in (("b1", self.b1), ("b2", self.b2)):
      if not 0.0 <= value < 1.0:
        raise ConfigError(key, value, "a float in [0, 1)")


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0 if cfg.warmup_steps else cfg.learning_rate,
    peak_value=cfg.learning_rate,
    warmup_steps=cfg.warmup_steps,
    decay_steps=cfg.warmup_steps + cfg.decay_steps,
    end_value=cfg.learning_rate * cfg.end_lr_ratio,
  )


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  chain = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm else []
  chain.append(
    optax.adamw(
      learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
  )
  # A very large limit: after that many consecutive bad steps optax would apply the bad update;
  # the training loop stops long before, at train.max_nonfinite_steps (it reads nonfinite_streak).
  return optax.apply_if_finite(optax.chain(*chain), max_consecutive_errors=2**30)


@flax.struct.dataclass
class TrainState:
  """Everything the update stage owns. ``params`` is the policy's ``nnx.State`` (Params only)."""

  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  rng: jax.Array


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, rng: jax.Array):
  return TrainState(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), rng=rng
  )


def skipped_updates(state: TrainState) -> jax.Array:
  """Total number of updates skipped because their gradients were not finite."""
  return state.opt_state.total_notfinite


def split_rows(batch: Any, n: int, what: str) -> Any:
  """[B, ...] leaves -> [n, B/n, ...], strided so every part spans every data shard."""

  def split(x: jax.Array) -> jax.Array:
    b = x.shape[0]
    if b % n:
      raise ValueError(f"batch {b} is not divisible by {what}={n}")
    return jnp.swapaxes(x.reshape(b // n, n, *x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def merge_rows(parts: Any) -> Any:
  """The inverse of ``split_rows``: [n, B/n, ...] leaves -> [B, ...] in the original row order."""
  return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), parts)


def _combine(key: str, a: jax.Array, b: jax.Array) -> jax.Array:
  if key.endswith("_max"):
    return jnp.maximum(a, b)
  if key.endswith("_min"):
    return jnp.minimum(a, b)
  return a + b


def _identity(key: str, like: jax.ShapeDtypeStruct) -> jax.Array:
  """The start of ``_combine``'s reduction for metric ``key``, shaped and typed ``like``."""
  if not key.endswith(("_max", "_min")):
    return jnp.zeros(like.shape, like.dtype)
  if jnp.issubdtype(like.dtype, jnp.floating):
    low, high = -jnp.inf, jnp.inf
  else:
    low, high = jnp.iinfo(like.dtype).min, jnp.iinfo(like.dtype).max
  return jnp.full(like.shape, low if key.endswith("_max") else high, like.dtype)


def _gradients(graphdef, params, batch, loss_fn, totals_fn, num_micro_batches):
  """Loss, float32 gradients and metrics of one (mini-)batch, accumulated over micro-batches."""
  totals = totals_fn(batch)

  def micro_loss(params: nnx.State, micro: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    return loss_fn(nnx.merge(graphdef, params), micro, totals)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
  f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)  # noqa: E731
  micros = split_rows(batch, num_micro_batches, "num_micro_batches")
  if num_micro_batches == 1:
    (loss, metrics), grads = grad_fn(params, jax.tree.map(lambda x: x[0], micros))
    return loss, f32(grads), metrics

  def accumulate(carry, micro):
    loss_acc, grads_acc, metrics_acc = carry
    (loss, metrics), grads = grad_fn(params, micro)
    grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
    metrics_acc = {k: _combine(k, metrics_acc[k], v) for k, v in metrics.items()}
    return (loss_acc + loss, grads_acc, metrics_acc), None

  # Every micro-batch inside the scan, from the identity of each sum / max / min (so the result
  # is the same to the bit as starting from the first): a micro-batch computed outside the loop,
  # next to a loop of one trip that XLA unrolls, let the scheduler interleave two micro-batches
  # and hold both one's activations (31M update, 32 x 288 in two micro-batches of 16: compiled
  # temp 3.7 GiB against 2.0 GiB for 16 rows alone).
  (loss0, metrics0), grads0 = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micros))
  init = (
    jnp.zeros(loss0.shape, loss0.dtype),
    jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), grads0),
    {k: _identity(k, v) for k, v in metrics0.items()},
  )
  (loss, grads, metrics), _ = jax.lax.scan(accumulate, init, micros)
  return loss, grads, metrics


def _finite_extremes(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A *_max / *_min that saw nothing is +-inf after combining; report it as 0."""
  return {
    k: jnp.where(jnp.isfinite(v), v, 0.0) if k.endswith(("_max", "_min")) else v
    for k, v in metrics.items()
  }


def _optimizer_step(graphdef, state, batch, loss_fn, totals_fn, optimizer, num_micro_batches):
  loss, grads, metrics = _gradients(
    graphdef, state.params, batch, loss_fn, totals_fn, num_micro_batches
  )
  # Accumulated in f32; handed to the optimiser in the parameters' dtype (a no-op for f32 master
  # weights; pure-bf16 opt-in keeps its moments bf16 as optax initialised them).
  cast = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  updates, opt_state = optimizer.update(cast, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  out = _finite_extremes(metrics)
  out.update(
    loss=loss,
    grad_norm=optax.tree.norm(grads),
    skipped_updates=opt_state.total_notfinite.astype(jnp.float32),
    nonfinite_streak=opt_state.notfinite_count.astype(jnp.float32),
  )
  return new_state, out


def _summarize(metrics_NxK: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Per-step metrics [N] -> one value: mean, max/min for *_max/*_min, last value of counters."""
  out = {}
  for k, v in metrics_NxK.items():
    if k.endswith("_max"):
      out[k] = jnp.max(v)
    elif k.endswith("_min"):
      out[k] = jnp.min(v)
    elif k in ("skipped_updates", "nonfinite_streak"):  # counters: the value after the last step
      out[k] = v[-1]
    else:
      out[k] = jnp.mean(v)
  return out


def update_step(
  graphdef: nnx.GraphDef,
  state: TrainState,
  batch: Any,
  *,
  loss_fn: LossFn,
  optimizer: optax.GradientTransformation,
  totals_fn: TotalsFn = no_totals,
  num_micro_batches: int = 1,
  num_mini_batches: int = 1,
  num_epochs: int = 1,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """``num_epochs x num_mini_batches`` optimiser steps on ``batch``.

  Each epoch shuffles the rows (a permutation drawn from the state's rng and step, so a resumed
  run repeats it) and splits them into ``num_mini_batches``; each mini-batch is one optimiser step
  whose gradient is accumulated over ``num_micro_batches`` in a scan (peak activation memory is
  that of one micro-batch). Metrics are averaged over the steps. Pure: jit it with the UPDATE
  plan's shardings and donate ``state`` (see ``parallel/executables.py``).
  """
  step = lambda s, b: _optimizer_step(  # noqa: E731
    graphdef, s, b, loss_fn, totals_fn, optimizer, num_micro_batches
  )
  if num_epochs == 1 and num_mini_batches == 1:
    return step(state, batch)
  b = jax.tree.leaves(batch)[0].shape[0]
  keys = jax.random.split(jax.random.fold_in(state.rng, state.step), num_epochs)

  def epoch(state: TrainState, key: jax.Array):
    order_B = jax.random.permutation(key, b)
    shuffled = jax.tree.map(lambda x: jnp.take(x, order_B, axis=0), batch)
    minis = split_rows(shuffled, num_mini_batches, "num_mini_batches")
    return jax.lax.scan(step, state, minis)

  state, metrics = jax.lax.scan(epoch, state, keys)
  return state, _summarize(jax.tree.map(lambda x: x.reshape(-1), metrics))
