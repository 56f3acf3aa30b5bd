"""The analytic memory model against the real Decoder and the compiled programs' memory_analysis."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import executables as ex
from earl_jax.parallel import memory_model as mm
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.parallel.presets import PRESETS
from earl_jax.rl import programs, reference, update
from earl_jax.sampler import engine
from earl_jax.types import Stage

CFG = ModelConfig(
  vocab_size=200, embed_dim=64, mlp_dim=192, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16
)
LOW, HIGH = mm.MEMORY_TOLERANCE


def _split(cfg: ModelConfig):
  return nnx.split(nnx.eval_shape(lambda: model_lib.Decoder(cfg, rngs=nnx.Rngs(0))))


@pytest.mark.parametrize("qkv_bias,tie", [(False, False), (True, True)])
@pytest.mark.parametrize("mesh", [(8, 1, 1), (1, 2, 4), (2, 4, 1)])
def test_param_shards_match_state_shardings(qkv_bias, tie, mesh):
  cfg = ModelConfig(**{**CFG.__dict__, "qkv_bias": qkv_bias, "tie_embeddings": tie})
  _, state = _split(cfg)
  plan = make_stage_plan(Stage.UPDATE, range(8), *mesh)
  shardings = mesh_lib.state_shardings(state, plan)
  leaves = jax.tree.leaves(state)
  want = sum(math.prod(s.shard_shape(x.shape)) for x, s in zip(leaves, jax.tree.leaves(shardings)))
  assert sum(x.size for x in leaves) == cfg.num_params
  assert mm.param_elements_per_device(cfg, plan) == want


def _check(compiled: ex.MemoryStats, predicted: mm.MemoryEstimate, what: str) -> None:
  ratio = predicted.total / compiled.peak
  assert LOW <= ratio <= HIGH, f"{what}: predicted/compiled = {ratio:.2f} ({predicted})"


@pytest.mark.parametrize("mesh,length", [((8, 1, 1), 256), ((2, 1, 4), 1024), ((1, 1, 4), 512)])
def test_rollout_prediction_matches_memory_analysis(mesh, length):
  graphdef, state = _split(CFG)
  devices = range(math.prod(mesh))
  plan = make_stage_plan(Stage.ROLLOUT, devices, *mesh)
  spec = engine.GenerationSpec(max_new_tokens=8)
  lowered = ex.lower_generate(plan, graphdef, state, length, spec, bucket=(8, 16))
  compiled = ex.MemoryStats.of(lowered.compile())
  w = mm.Workload(Stage.ROLLOUT, load=8, length=length, prompt_chunk=16, new_tokens=8)
  _check(compiled, mm.estimate_memory(CFG, plan, w, mm.CPU_SPEC), f"rollout {mesh} S={length}")


# On CPU, attention "auto" runs naive up to the attention block (512) and chunked past it: these
# cover both.
@pytest.mark.parametrize("mesh,length", [((8, 1, 1), 1024), ((2, 1, 4), 512), ((1, 1, 4), 256)])
def test_reference_prediction_matches_memory_analysis(mesh, length):
  graphdef, state = _split(CFG)
  plan = make_stage_plan(Stage.REFERENCE, range(math.prod(mesh)), *mesh)
  lowered = programs.lower_score(plan, graphdef, state, bucket=(8, length), chunk_size=64)
  compiled = ex.MemoryStats.of(lowered.compile())
  w = mm.Workload(Stage.REFERENCE, load=8, length=length, logits_chunk=64)
  _check(compiled, mm.estimate_memory(CFG, plan, w, mm.CPU_SPEC), f"reference {mesh} T={length}")


def pg_loss(remat: str, chunk: int) -> update.LossFn:
  def loss_fn(m: nnx.Module, batch: dict, totals: None) -> tuple[jax.Array, dict]:
    logps_BxT, _ = reference.token_logps(
      m, batch["tokens"], batch["positions"], batch["valid"], chunk_size=chunk, remat=remat
    )
    return -jnp.mean(logps_BxT * batch["adv"][:, None]), {}

  return loss_fn


def abstract_update_inputs(cfg: ModelConfig, b: int, t: int):
  optimizer = update.make_optimizer(update.OptimConfig())

  def init() -> update.TrainState:
    params = nnx.state(model_lib.Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    return update.init_train_state(params, optimizer, jax.random.key(0))

  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in ("tokens", "positions")}
  batch["valid"] = jax.ShapeDtypeStruct((b, t), jnp.bool_)
  batch["adv"] = jax.ShapeDtypeStruct((b,), jnp.float32)
  return jax.eval_shape(init), batch, optimizer


# auto: naive on CPU at T 256; forward_layers auto: unrolled on CPU unless rematerialised.
@pytest.mark.parametrize(
  "attention,layers", [("auto", "auto"), ("auto", "scan"), ("chunked", "auto")]
)
@pytest.mark.parametrize("mesh,remat,mb", [((2, 4, 1), "none", 0), ((1, 1, 4), "full", 4)])
def test_update_prediction_matches_memory_analysis(mesh, remat, mb, attention, layers):
  cfg = ModelConfig(**{**CFG.__dict__, "attention": attention, "forward_layers": layers})
  graphdef, _ = _split(cfg)
  train_state, batch, optimizer = abstract_update_inputs(cfg, 8, 256)
  plan = make_stage_plan(
    Stage.UPDATE, range(math.prod(mesh)), *mesh, remat=remat, micro_batch_size=mb
  )
  lowered = programs.lower_update(
    plan, graphdef, train_state, batch, loss_fn=pg_loss(remat, 64), optimizer=optimizer
  )
  compiled = ex.MemoryStats.of(lowered.compile())
  w = mm.Workload(Stage.UPDATE, load=8, length=256, logits_chunk=64)
  predicted = mm.estimate_memory(cfg, plan, w, mm.CPU_SPEC)
  _check(compiled, predicted, f"update {attention} {layers} {mesh} {remat} mb={mb}")


def test_paper_scale_sizes():
  """Qwen2.5-72B: ~145 GB of bf16 weights, 320 KiB of KV cache per token (earl_paper.md s3)."""
  cfg = PRESETS["qwen2.5-72b"]
  plan = make_stage_plan(Stage.ROLLOUT, range(8), 1, 1, 8)
  weights = mm.param_elements_per_device(cfg, plan) * 2 * 8
  assert 144e9 < weights < 147e9
  one = mm.estimate_memory(cfg, plan, mm.Workload(Stage.ROLLOUT, 1, 1024, prompt_chunk=1))
  two = mm.estimate_memory(cfg, plan, mm.Workload(Stage.ROLLOUT, 1, 2048, prompt_chunk=1))
  assert (two.kv_cache - one.kv_cache) * 8 // 1024 == pytest.approx(327680, rel=0.01)


def test_step_time_model_shapes():
  """Decode: weight-bound at small batch (tensor helps), latency grows with the tensor size."""
  cfg = PRESETS["qwen2.5-72b"]
  p4 = make_stage_plan(Stage.ROLLOUT, range(4), 1, 1, 4)
  p8 = make_stage_plan(Stage.ROLLOUT, range(8), 1, 1, 8)
  w = mm.Workload(Stage.ROLLOUT, load=4, length=1024, new_tokens=1, prompt_chunk=1)
  t4, t8 = mm.estimate_seconds(cfg, p4, w), mm.estimate_seconds(cfg, p8, w)
  assert t8 < t4  # fewer weight bytes per device and step
  assert 4 * t4 < 8 * t8  # but per GPU, TP=4 is more efficient (all-reduce latency)
  long = mm.Workload(Stage.ROLLOUT, load=64, length=32768, new_tokens=1, prompt_chunk=1)
  assert mm.estimate_seconds(cfg, p8, long) > 4 * mm.estimate_seconds(cfg, p8, w)  # KV-bound
