"""Meshes and shardings from a StagePlan: the only place logical names become mesh axes.

Data flow: a stage's ``StagePlan`` -> ``build_mesh`` -> ``state_shardings`` (parameters, optimizer
state) / ``batch_sharding`` (batches) / ``logical_to_sharding`` (any other array) -> the jitted
stage programs and the dispatcher. ``create_sharded`` initialises a module directly in its
sharded layout, so full parameters never sit on one device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from earl_jax.parallel.plan import ShardingError, StagePlan, logical_to_spec
from earl_jax.types import BATCH, MESH_AXES


@functools.lru_cache(maxsize=256)
def _mesh(device_ids: tuple[int, ...], mesh_shape: tuple[int, ...]) -> Mesh:
  by_id = {d.id: d for d in jax.devices()}
  missing = [i for i in device_ids if i not in by_id]
  if missing:
    raise ShardingError(f"device ids {missing} do not exist; this job has ids {sorted(by_id)}")
  devices = np.array([by_id[i] for i in device_ids], dtype=object).reshape(mesh_shape)
  # Auto axes, not jax.make_mesh's Explicit default: Explicit breaks plain indexing (P6).
  return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def build_mesh(plan: StagePlan) -> Mesh:
  """The (data, fsdp, tensor) mesh of a plan; cached, so equal plans give equal shardings."""
  return _mesh(plan.device_ids, plan.mesh_shape)


def logical_to_sharding(
  logical_spec: PartitionSpec | Sequence[Any], shape: Sequence[int], plan: StagePlan
) -> NamedSharding:
  """NamedSharding for an array of ``shape`` with logical axes; raises on non-divisible dims."""
  return NamedSharding(build_mesh(plan), logical_to_spec(logical_spec, shape, plan))


def batch_sharding(plan: StagePlan, ndim: int, batch_size: int | None = None) -> NamedSharding:
  """Sharding of a [B, ...] batch array: B over the plan's batch axes, the rest replicated."""
  if ndim < 1:
    raise ShardingError(f"batch_sharding needs ndim >= 1, got {ndim}")
  shape = (plan.shards_for(BATCH) if batch_size is None else batch_size,) + (1,) * (ndim - 1)
  return logical_to_sharding((BATCH,), shape, plan)


def _check_annotated(abstract_state: nnx.State) -> None:
  flat = jax.tree_util.tree_flatten_with_path(
    abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]
  for path, var in flat:
    if not isinstance(var, nnx.Variable):
      continue
    value = var.get_value()
    if getattr(value, "ndim", 0) > 0 and var.get_metadata().get("out_sharding") is None:
      raise ShardingError(
        f"variable {jax.tree_util.keystr(path)} of shape {value.shape} has no logical axes; "
        "create it with nnx.Param(value, out_sharding=(<logical names>), eager_sharding=False)"
      )


def state_shardings(abstract_state: nnx.State, plan: StagePlan) -> nnx.State:
  """Tree of NamedSharding (same structure as the state) from the variables' logical axes."""
  _check_annotated(abstract_state)
  specs = nnx.get_partition_spec(abstract_state)
  return jax.tree.map(
    lambda spec, leaf: logical_to_sharding(spec, leaf.shape, plan),
    specs,
    abstract_state,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def create_sharded(init_fn: Callable[[], nnx.Module], plan: StagePlan) -> nnx.Module:
  """Builds ``init_fn()`` with every variable created directly in the plan's sharding."""
  abstract = nnx.eval_shape(init_fn)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, plan)

  def init_state() -> nnx.State:
    return nnx.state(init_fn())

  state = jax.jit(init_state, out_shardings=shardings)()
  return nnx.merge(graphdef, state)
