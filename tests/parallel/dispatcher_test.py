"""Tests for earl_jax.parallel.dispatcher: values, target shardings, host-freedom, accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import dispatcher
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel import plan as plan_lib
from earl_jax.types import BATCH, MLP, Stage

_MESHES = [(1, 4, 2), (2, 1, 4), (8, 1, 1), (1, 1, 8), (2, 2, 2), (1, 2, 2), (2, 1, 2), (1, 2, 1)]
_DEVICE_SETS = {
  8: [list(range(8)), [7, 6, 5, 4, 3, 2, 1, 0]],
  4: [[0, 1, 2, 3], [4, 5, 6, 7]],
  2: [[0, 1], [6, 7]],
}


def _random_plan(rng: np.random.Generator, stage: Stage) -> plan_lib.StagePlan:
  shape = _MESHES[rng.integers(len(_MESHES))]
  options = _DEVICE_SETS[int(np.prod(shape))]
  return plan_lib.make_stage_plan(stage, options[rng.integers(len(options))], *shape)


def _random_array(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
  dtype = [np.float32, np.int32, jnp.bfloat16][rng.integers(3)]
  return (rng.standard_normal(shape) * 100).astype(dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_plan_pairs_move_values_exactly_without_host(seed):
  rng = np.random.default_rng(seed)
  src_plan, dst_plan = _random_plan(rng, Stage.UPDATE), _random_plan(rng, Stage.ROLLOUT)
  tree, dsts = {}, {}
  for i, logical in enumerate([(BATCH, None), (None, MLP), (BATCH, None, MLP), (MLP,)]):
    shape = tuple(8 * int(rng.integers(1, 3)) for _ in logical)
    host = _random_array(rng, shape)
    src_logical = tuple(reversed(logical)) if len(logical) == 2 else logical
    tree[f"x{i}"] = jax.device_put(host, mesh_lib.logical_to_sharding(src_logical, shape, src_plan))
    dsts[f"x{i}"] = mesh_lib.logical_to_sharding(logical, shape, dst_plan)
  expected = {k: np.asarray(v) for k, v in tree.items()}
  with jax.transfer_guard("disallow_explicit"):
    out, stats = dispatcher.dispatch(tree, dsts)
  for k in tree:
    assert out[k].sharding == dsts[k], (k, src_plan.describe(), dst_plan.describe())
    assert out[k].dtype == expected[k].dtype
    np.testing.assert_array_equal(np.asarray(out[k]), expected[k])
  assert stats.bytes_through_host == 0 and len(stats.routes) == 4
  assert stats.bytes_total == sum(v.nbytes for v in expected.values())


def test_routes_and_byte_accounting():
  a = plan_lib.make_stage_plan(Stage.UPDATE, range(4), 1, 4, 1)
  same_layout = plan_lib.make_stage_plan(Stage.ROLLOUT, range(4, 8), 1, 4, 1)
  relayout = plan_lib.make_stage_plan(Stage.ROLLOUT, range(4), 1, 1, 4)
  x = jax.device_put(
    np.ones((8, 16), np.float32), mesh_lib.logical_to_sharding((BATCH,), (8, 16), a)
  )
  for dst_plan, logical, route, moved in [
    (a, (BATCH,), "noop", 0),
    (same_layout, (BATCH,), "put", 512),  # every block changes device
    (relayout, (None, MLP), "jit", 384),  # each device keeps 1/4 of its new column block
  ]:
    dst = mesh_lib.logical_to_sharding(logical, x.shape, dst_plan)
    with jax.transfer_guard("disallow_explicit"):
      y, stats = dispatcher.dispatch([x], [dst], account=True)
    assert stats.route_counts() == {route: 1} and stats.bytes_moved == moved
    assert stats.bytes_busiest_process == moved and y[0].sharding == dst
  y, stats = dispatcher.dispatch([x], [dst], mode="centralized", account=True)
  np.testing.assert_array_equal(np.asarray(y[0]), 1.0)
  # Counted copies: 4 row blocks fetched, 4 column blocks scattered.
  assert stats.bytes_through_host == 512 + 512 and stats.route_counts() == {"host": 1}
  assert stats.num_transfers == 8


def test_centralized_fetches_one_replica_per_block():
  plan = plan_lib.make_stage_plan(Stage.UPDATE, range(8), 2, 1, 4)  # rows over 2, replicated x4
  x = jax.device_put(np.ones((8, 16), np.float32), mesh_lib.batch_sharding(plan, 2, 8))
  dst = mesh_lib.batch_sharding(plan_lib.make_stage_plan(Stage.ROLLOUT, range(8), 8, 1, 1), 2, 8)
  _, stats = dispatcher.dispatch([x], [dst], mode="centralized", account=True)
  # jax.device_get fetches one replica per block: 2 blocks of 256 bytes, not 8 shards.
  assert stats.bytes_through_host == 512 + 512 and stats.num_transfers == 2 + 8


def test_accounting_and_timing_are_opt_in_and_costs_are_cached():
  a = plan_lib.make_stage_plan(Stage.UPDATE, range(4), 1, 4, 1)
  b = plan_lib.make_stage_plan(Stage.ROLLOUT, range(4, 8), 1, 1, 4)
  x = jax.device_put(
    np.ones((8, 16), np.float32), mesh_lib.logical_to_sharding((BATCH,), (8, 16), a)
  )
  dst = mesh_lib.logical_to_sharding((None, MLP), x.shape, b)
  _, plain = dispatcher.dispatch([x], [dst])
  assert plain.bytes_moved is None and plain.num_transfers is None and plain.seconds is None
  assert plain.bytes_through_host == 0 and plain.bytes_total == 512
  dispatcher._leaf_cost.cache_clear()
  _, first = dispatcher.dispatch([x], [dst], account=True, measure=True)
  _, second = dispatcher.dispatch([x], [dst], account=True)
  assert first.bytes_moved == second.bytes_moved > 0 and first.seconds > 0
  info = dispatcher._leaf_cost.cache_info()
  assert info.misses == 1 and info.hits == 1


def test_direct_mode_shuts_the_host_out(monkeypatch):
  # Force the plain device_put onto a pair whose blocks do not line up across device sets: jax
  # would gather it on the host. The direct mode must raise instead of copying silently.
  a = plan_lib.make_stage_plan(Stage.UPDATE, range(4), 1, 4, 1)
  b = plan_lib.make_stage_plan(Stage.ROLLOUT, range(4, 8), 1, 1, 4)
  x = jax.device_put(
    np.ones((8, 16), np.float32), mesh_lib.logical_to_sharding((BATCH,), (8, 16), a)
  )
  dst = mesh_lib.logical_to_sharding((None, MLP), x.shape, b)
  monkeypatch.setattr(dispatcher, "_route", lambda *args: "put")
  with pytest.raises(Exception, match="Disallowed"):
    dispatcher.dispatch([x], [dst])


def test_centralized_mode_goes_through_host():
  a = plan_lib.make_stage_plan(Stage.UPDATE, range(8), 8, 1, 1)
  x = jax.device_put(np.ones((8, 16), np.float32), mesh_lib.batch_sharding(a, 2, 8))
  dst = mesh_lib.logical_to_sharding(
    (None, MLP), x.shape, plan_lib.make_stage_plan(Stage.ROLLOUT, range(8), 1, 1, 4 * 2)
  )
  with jax.transfer_guard("disallow_explicit"), pytest.raises(Exception, match="Disallowed"):
    dispatcher.dispatch([x], [dst], mode="centralized")


def test_weight_sync_update_to_rollout_keeps_logits():
  cfg = ModelConfig(
    vocab_size=50,
    embed_dim=32,
    mlp_dim=64,
    num_layers=1,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    vocab_multiple=16,
  )
  update = plan_lib.make_stage_plan(Stage.UPDATE, range(8), 1, 4, 2)
  rollout = plan_lib.make_stage_plan(Stage.ROLLOUT, range(8), 2, 1, 4)
  for p in (update, rollout):
    plan_lib.validate_for_model(p, cfg, batch_size=4)
  model = mesh_lib.create_sharded(lambda: model_lib.Decoder(cfg, rngs=nnx.Rngs(0)), update)
  graphdef, state = nnx.split(model)
  tokens_BxT = jnp.asarray(np.random.default_rng(0).integers(0, 50, (4, 5)), jnp.int32)
  before = np.asarray(model_lib.logits(model, tokens_BxT))
  with jax.transfer_guard("disallow_explicit"):
    synced, stats = dispatcher.sync_weights(state, rollout)
  assert stats.bytes_through_host == 0 and set(stats.route_counts()) <= {"jit", "noop", "put"}
  want = mesh_lib.state_shardings(state, rollout)
  for got, spec in zip(jax.tree.leaves(synced), jax.tree.leaves(want)):
    assert got.sharding == spec
  after = np.asarray(model_lib.logits(nnx.merge(graphdef, synced), tokens_BxT))
  np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)
