"""The policy-update stage: train state and one optimiser step over a batch of micro-batches.

Data flow: AdvantageBatch --dispatch--> update@UPDATE plan --> new TrainState (params then go back
to the rollout layout by weight sync). The loss itself is injected (``loss_fn``) so the update
stage does not depend on a particular RL objective; ``rl/objective.py`` builds the PPO/GRPO one.

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

LossFn = Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, jax.Array]]]


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
  # the training loop stops long before (it watches skipped_updates).
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


def _micro_batches(batch: Any, num_micro_batches: int) -> Any:
  """[B, ...] leaves -> [M, B/M, ...], strided so every micro-batch spans every data shard."""

  def split(x: jax.Array) -> jax.Array:
    b = x.shape[0]
    if b % num_micro_batches:
      raise ValueError(f"batch {b} is not divisible by num_micro_batches={num_micro_batches}")
    return jnp.swapaxes(x.reshape(b // num_micro_batches, num_micro_batches, *x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def update_step(
  graphdef: nnx.GraphDef,
  state: TrainState,
  batch: Any,
  *,
  loss_fn: LossFn,
  optimizer: optax.GradientTransformation,
  num_micro_batches: int = 1,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimiser step; gradients are accumulated over ``num_micro_batches`` in a scan.

  The loss (and every metric) is the mean over micro-batches of ``loss_fn``'s value, so peak
  activation memory is that of one micro-batch. Pure: jit it with the UPDATE plan's shardings and
  donate ``state`` (see ``parallel/executables.py``).
  """

  def micro_loss(params: nnx.State, micro: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    return loss_fn(nnx.merge(graphdef, params), micro)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def accumulate(carry, micro):
    grads_acc, loss_acc, metrics_acc = carry
    (loss, metrics), grads = grad_fn(state.params, micro)
    add = lambda a, b: a + b  # noqa: E731
    return (
      jax.tree.map(add, grads_acc, grads),
      loss_acc + loss,
      jax.tree.map(add, metrics_acc, metrics),
    ), None

  micros = _micro_batches(batch, num_micro_batches)
  first = jax.tree.map(lambda x: x[0], micros)
  metrics_shape = jax.eval_shape(lambda p, m: micro_loss(p, m)[1], state.params, first)
  zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
  init = (
    zeros(jax.eval_shape(lambda: state.params)),
    jnp.zeros((), jnp.float32),
    zeros(metrics_shape),
  )
  (grads, loss, metrics), _ = jax.lax.scan(accumulate, init, micros)
  scale = 1.0 / num_micro_batches
  grads = jax.tree.map(lambda g: g * scale, grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  out = {k: v * scale for k, v in metrics.items()}
  out.update(
    loss=loss * scale,
    grad_norm=optax.tree.norm(grads),
    skipped_updates=opt_state.total_notfinite,
  )
  return new_state, out
