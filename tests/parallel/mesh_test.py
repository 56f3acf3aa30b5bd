"""Tests for earl_jax.parallel.mesh: Auto-axis meshes, state shardings, sharded creation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel import plan as plan_lib
from earl_jax.types import EMBED, MLP, NORM, Stage


class _Tiny(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, annotate: bool = True):
    names = {"out_sharding": (EMBED, MLP), "eager_sharding": False} if annotate else {}
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 12)), **names)
    self.scale = nnx.Param(jnp.ones((8,)), out_sharding=(NORM,), eager_sharding=False)


def test_build_mesh_uses_auto_axes_and_device_order():
  p = plan_lib.make_stage_plan(Stage.UPDATE, [3, 2, 1, 0], 1, 2, 2)
  mesh = mesh_lib.build_mesh(p)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert mesh.axis_types == (AxisType.Auto,) * 3
  assert [d.id for d in mesh.devices.flat] == [3, 2, 1, 0]
  assert mesh_lib.build_mesh(p) is mesh
  with pytest.raises(plan_lib.ShardingError, match="do not exist"):
    mesh_lib.build_mesh(plan_lib.make_stage_plan(Stage.UPDATE, [0, 99], 1, 2, 1))


def test_create_sharded_places_every_param():
  p = plan_lib.make_stage_plan(Stage.UPDATE, range(8), 1, 4, 2)
  model = mesh_lib.create_sharded(lambda: _Tiny(nnx.Rngs(0)), p)
  mesh = mesh_lib.build_mesh(p)
  assert model.w[...].sharding == NamedSharding(mesh, P("fsdp", "tensor"))
  assert model.scale[...].sharding == NamedSharding(mesh, P())
  np.testing.assert_allclose(np.asarray(model.w[...]), np.asarray(_Tiny(nnx.Rngs(0)).w[...]))
  assert mesh_lib.batch_sharding(p, 2).spec == P("fsdp")


def test_unannotated_params_are_refused():
  p = plan_lib.make_stage_plan(Stage.UPDATE, range(8), 1, 4, 2)
  with pytest.raises(plan_lib.ShardingError, match="has no logical axes"):
    mesh_lib.create_sharded(lambda: _Tiny(nnx.Rngs(0), annotate=False), p)
