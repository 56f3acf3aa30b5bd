"""Executable cache (issue #4 item 5): per-plan programs with explicit shardings and donation,
memory/cost analyses exposed, and compilations reused when (stage, plan, bucket) repeats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import executables as ex
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.rl import programs, reference, update
from earl_jax.sampler import engine
from earl_jax.types import Stage

CFG = ModelConfig(
  vocab_size=200, embed_dim=32, mlp_dim=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)


def _model(plan):
  return mesh_lib.create_sharded(lambda: model_lib.Decoder(CFG, rngs=nnx.Rngs(0)), plan)


def _batch(b: int, t: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (b, t)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return tokens, positions, jnp.ones((b, t), jnp.bool_)


def test_generate_program_donates_cache_and_reports_analyses():
  plan = make_stage_plan(Stage.ROLLOUT, range(8), 4, 1, 2)
  graphdef, state = nnx.split(_model(plan))
  spec = engine.GenerationSpec(max_new_tokens=4)
  abstract = jax.eval_shape(lambda: state)
  cache = ex.ExecutableCache()
  program = cache.get(
    Stage.ROLLOUT,
    plan,
    (8, 8),
    lambda: ex.lower_generate(plan, graphdef, abstract, 32, spec, bucket=(8, 8)),
  )
  assert program.memory.peak > 0 and program.memory.alias > 0  # the donated cache aliases
  assert program.flops > 0 and program.bytes_accessed > 0 and program.compile_seconds > 0
  kv = model_lib.init_cache(CFG, 8, 32)
  kv = jax.device_put(kv, ex.cache_shardings(plan, kv))
  row2, row1 = mesh_lib.batch_sharding(plan, 2), mesh_lib.batch_sharding(plan, 1)
  tokens, positions, mask = (jax.device_put(x, row2) for x in _batch(8, 8))
  active = jax.device_put(jnp.ones((8,), jnp.bool_), row1)
  key = jax.device_put(jax.random.key(0), ex.replicated(plan))
  out, new_kv = program(state, kv, tokens, mask, positions, active, key)
  assert kv.k.is_deleted()  # donated
  assert out.tokens_BxN.shape == (8, 4) and new_kv.k.sharding == ex.cache_shardings(plan, kv).k
  want, _ = engine.make_generate_fn(graphdef, spec)(
    state, model_lib.init_cache(CFG, 8, 32), *_batch(8, 8)[::2], _batch(8, 8)[1], active, key
  )
  np.testing.assert_array_equal(out.tokens_BxN, want.tokens_BxN)


def test_score_program_matches_unsharded_reference_and_cache_counts_compiles():
  plans = [make_stage_plan(Stage.REFERENCE, range(8), d, 1, 8 // d) for d in (8, 4)]
  graphdef, state = nnx.split(_model(plans[0]))
  abstract = jax.eval_shape(lambda: state)
  cache = ex.ExecutableCache()

  def get(plan, t):
    lower = lambda: programs.lower_score(plan, graphdef, abstract, bucket=(8, t), chunk_size=8)  # noqa: E731
    return cache.get(Stage.REFERENCE, plan, (8, t), lower)

  a = get(plans[0], 16)
  assert get(plans[0], 16) is a and cache.compilations == 1
  b = get(plans[1], 16)  # the plan changed: a new program
  assert cache.compilations == 2 and b is not a
  assert get(plans[0], 16) is a and get(plans[1], 16) is b and cache.compilations == 2
  get(plans[0], 32)  # a new bucket compiles once more
  assert cache.compilations == 3 and len(cache) == 3

  tokens, positions, valid = _batch(8, 16, seed=1)
  want, _ = reference.token_logps(
    nnx.merge(graphdef, state), tokens, positions, valid, chunk_size=8
  )
  sharded = [jax.device_put(x, mesh_lib.batch_sharding(plans[1], 2)) for x in (tokens, positions)]
  state_b = jax.device_put(state, mesh_lib.state_shardings(state, plans[1]))
  got = b(state_b, *sharded, jax.device_put(valid, mesh_lib.batch_sharding(plans[1], 2)))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_score_program_in_waves_gives_the_same_logps_with_one_wave_of_activations_live():
  """A reference plan with micro_batch_size runs the rows in waves inside the program: the
  log-probs are those of the whole batch at once, and the compiled temporaries shrink."""
  b, t = 16, 256
  whole, waves = (
    make_stage_plan(Stage.REFERENCE, range(8), 4, 1, 2, micro_batch_size=mb) for mb in (0, 4)
  )
  graphdef, state = nnx.split(_model(whole))
  abstract = jax.eval_shape(lambda: state)
  cache = ex.ExecutableCache()
  programs_ = [
    cache.get(
      Stage.REFERENCE,
      p,
      (b, t),
      lambda p=p: programs.lower_score(p, graphdef, abstract, bucket=(b, t), chunk_size=64),
    )
    for p in (whole, waves)
  ]
  rows = [jax.device_put(x, mesh_lib.batch_sharding(whole, 2)) for x in _batch(b, t, seed=2)]
  want, got = (program(state, *rows) for program in programs_)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert programs_[1].memory.temp < 0.5 * programs_[0].memory.temp, [p.memory for p in programs_]


def test_update_program_steps_and_donates_train_state():
  plan = make_stage_plan(Stage.UPDATE, range(8), 2, 2, 2, micro_batch_size=4, remat="full")
  graphdef, params = nnx.split(_model(plan), nnx.Param)
  optimizer = update.make_optimizer(update.OptimConfig(learning_rate=1e-2))
  state = update.init_train_state(params, optimizer, jax.random.key(0))
  shardings = ex.train_state_shardings(plan, jax.eval_shape(lambda: state), optimizer)
  state = jax.device_put(state, shardings)
  tokens, positions, valid = _batch(8, 16, seed=2)
  batch = {"tokens": tokens, "positions": positions, "valid": valid}

  def loss_fn(m, mb, totals):
    logps_BxT, _ = reference.token_logps(
      m, mb["tokens"], mb["positions"], mb["valid"], chunk_size=8, remat="full"
    )
    return -jnp.mean(logps_BxT), {}

  abstract_batch = jax.eval_shape(lambda: batch)
  lowered = programs.lower_update(
    plan, graphdef, jax.eval_shape(lambda: state), abstract_batch, loss_fn=loss_fn,
    optimizer=optimizer,
  )  # fmt: skip
  program = ex.ExecutableCache().get(Stage.UPDATE, plan, (8, 16), lambda: lowered)
  assert program.memory.alias > 0 and program.flops > 0
  old_embed = np.asarray(state.params["embed"][...])
  batch = jax.device_put(batch, mesh_lib.batch_sharding(plan, 2))
  new_state, metrics = program(state, batch)
  assert jax.tree.leaves(state.params)[0].is_deleted()  # donated
  assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))
  assert not np.allclose(np.asarray(new_state.params["embed"][...]), old_embed)
  spec = jax.tree.leaves(new_state.params)[0].sharding
  assert spec == jax.tree.leaves(shardings.params)[0]
