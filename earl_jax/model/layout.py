"""Activation sharding constraints in logical axis names, resolved by the stage being compiled.

Data flow: ``parallel/executables.py`` lowers each stage program inside
``activation_layout(resolver)``, where ``resolver(logical_axes, shape)`` maps logical names to a
``NamedSharding`` with the stage plan's rules (failing closed on a dimension that does not divide
its mesh axes). Model code calls ``constrain(x, (BATCH, SEQ, None))`` at block boundaries: the
layout of activations under fsdp x tensor is then what the plan says, not whatever XLA's
propagation picks. Outside such a context (tests, eager use) ``constrain`` does nothing, so the
model never names a mesh axis.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax

Resolver = Callable[[Sequence[str | None], Sequence[int]], jax.sharding.Sharding]

_RESOLVER: contextvars.ContextVar[Resolver | None] = contextvars.ContextVar(
  "earl_jax_activation_layout", default=None
)


@contextlib.contextmanager
def activation_layout(resolver: Resolver | None) -> Iterator[None]:
  """Traces inside this context constrain activations with ``resolver``."""
  token = _RESOLVER.set(resolver)
  try:
    yield
  finally:
    _RESOLVER.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """``x`` constrained to the sharding of ``logical_axes`` under the current stage plan."""
  resolver = _RESOLVER.get()
  if resolver is None:
    return x
  return jax.lax.with_sharding_constraint(x, resolver(tuple(logical_axes), x.shape))
