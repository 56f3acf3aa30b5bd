"""The update stage gives the same step on an (fsdp=4, tensor=2) plan as on a single device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import executables
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.rl import batches, losses, objective, programs, update
from earl_jax.types import Stage

CFG = ModelConfig(
  vocab_size=37, embed_dim=24, mlp_dim=40, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
  vocab_multiple=8,
)  # fmt: skip


def _batch(b: int = 8, t: int = 16) -> batches.AdvantageBatch:
  rng = np.random.default_rng(0)
  lengths = rng.integers(6, t + 1, size=b)
  valid = np.arange(t)[None, :] < lengths[:, None]
  tokens = np.where(valid, rng.integers(1, CFG.vocab_size, size=(b, t)), 0).astype(np.int32)
  loss_mask = valid & (np.arange(t)[None, :] >= 3)
  logps = np.where(loss_mask, -rng.uniform(0.5, 4.0, size=(b, t)), 0).astype(np.float32)
  rb = batches.RolloutBatch.create(
    tokens_BxT=tokens,
    positions_BxT=(np.arange(t)[None, :] * valid).astype(np.int32),
    valid_BxT=valid,
    loss_mask_BxT=loss_mask,
    sampler_logps_BxT=logps,
    rewards_B=rng.normal(size=b).astype(np.float32),
    group_ids_B=(np.arange(b) // 2).astype(np.int32),
  )
  sb = batches.ScoredBatch.from_rollout(rb, ref_logps_BxT=logps - 0.1, old_logps_BxT=logps)
  adv = np.where(loss_mask, rng.normal(size=(b, t)), 0).astype(np.float32)
  return batches.AdvantageBatch.from_scored(sb, advantages_BxT=adv, returns_BxT=adv)


def _one_step(plan, params, batch):
  # Sharded reductions sum in another order. With Adam's default eps a first step is
  # ~lr * g / |g|, which turns f32 noise on near-zero gradients into O(lr) differences; eps=1e-3
  # keeps the step a smooth function of the gradient so the comparison is well conditioned.
  optimizer = update.make_optimizer(update.OptimConfig(learning_rate=1e-2, eps=1e-3))
  state = update.init_train_state(params, optimizer, jax.random.key(0))
  loss_fn = objective.Objective(losses.LossConfig(kl_beta=0.05), chunk_size=8)
  graphdef = nnx.graphdef(model_lib.Decoder(CFG, rngs=nnx.Rngs(0)))
  sds = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
  program = executables.ExecutableCache().get(
    Stage.UPDATE,
    plan,
    batch.tokens_BxT.shape,
    lambda: programs.lower_update(
      plan,
      graphdef,
      sds(state),
      sds(batch),
      loss_fn=loss_fn,
      optimizer=optimizer,
      totals_fn=loss_fn.totals,
    ),
  )
  state = jax.device_put(state, executables.train_state_shardings(plan, state, optimizer))
  batch = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(plan, x.ndim)), batch)
  new_state, metrics = program(state, batch)
  return new_state, {k: float(v) for k, v in metrics.items()}


@pytest.mark.requires_devices(8)
def test_fsdp4_tensor2_update_equals_single_device():
  params = nnx.state(model_lib.Decoder(CFG, rngs=nnx.Rngs(3)))
  batch = _batch()
  single = make_stage_plan(Stage.UPDATE, [0], 1, 1, 1, micro_batch_size=4)
  sharded = make_stage_plan(Stage.UPDATE, list(range(8)), 1, 4, 2, micro_batch_size=4)
  copy = lambda tree: jax.tree.map(jnp.array, tree)  # noqa: E731  (the step donates its state)
  state_1, metrics_1 = _one_step(single, copy(params), batch)
  state_8, metrics_8 = _one_step(sharded, copy(params), batch)
  q = state_8.params["blocks"]["attn"]["q"].get_value()
  assert q.addressable_shards[0].data.shape[1:] == (6, 2, 8)  # embed/4, heads/2: really sharded
  assert metrics_1["skipped_updates"] == 0 and metrics_1["loss"] != 0
  for key, value in metrics_1.items():
    assert metrics_8[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6),
    state_1.params,
    state_8.params,
  )
