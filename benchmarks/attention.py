"""Naive vs blockwise attention in the reference and update programs: compiled peak and time.

For each context T the reference (log-probs) and update (PPO step, fwd + bwd + AdamW) programs of
a fixed small model are lowered from abstract shapes and compiled on one device; the table gives
``memory_analysis`` peak (argument + output + temp - alias) per program and, where
T <= --time-max-t, the median wall time of --repeats runs (compile excluded). A linear fit of the
chunked peaks over T shows the slope (bytes per token) and its worst relative residual.

  PYTHONPATH=. python benchmarks/attention.py [--lengths 1024,2048,4096,8192,16384]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from earl_jax import hostmem
from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import executables as ex
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.rl import batches, losses, objective, programs, update
from earl_jax.types import Stage

MODEL = ModelConfig(
  vocab_size=512, embed_dim=256, mlp_dim=512, num_layers=2, num_heads=4, num_kv_heads=2,
  head_dim=64, max_seq_len=16384,
)  # fmt: skip
CHUNK = 256  # logits chunk


def _abstract_batch(b: int, t: int) -> batches.AdvantageBatch:
  def sds(dtype):
    return jax.ShapeDtypeStruct((b, t), dtype)

  f32 = sds(jnp.float32)
  return batches.AdvantageBatch(
    tokens_BxT=sds(jnp.int32), positions_BxT=sds(jnp.int32), valid_BxT=sds(jnp.bool_),
    loss_mask_BxT=sds(jnp.bool_), sampler_logps_BxT=f32,
    rewards_B=jax.ShapeDtypeStruct((b,), jnp.float32),
    group_ids_B=jax.ShapeDtypeStruct((b,), jnp.int32),
    token_rewards_BxT=f32, answer_bits_BxT=sds(jnp.int32), expert_bits_BxT=sds(jnp.int32),
    ref_logps_BxT=f32, old_logps_BxT=f32, advantages_BxT=f32,
    returns_BxT=f32,
  )  # fmt: skip


def _programs(attention: str, t: int, b: int):
  cfg = dataclasses.replace(MODEL, attention=attention)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.Decoder(cfg, rngs=nnx.Rngs(0))))
  ref_plan = make_stage_plan(Stage.REFERENCE, [0], 1, 1, 1)
  upd_plan = make_stage_plan(Stage.UPDATE, [0], 1, 1, 1, remat="full")
  score = programs.lower_score(ref_plan, graphdef, state, (b, t), chunk_size=CHUNK).compile()
  optimizer = update.make_optimizer(update.OptimConfig())
  train = jax.eval_shape(lambda: update.init_train_state(state, optimizer, jax.random.key(0)))
  obj = objective.Objective(losses.LossConfig(), chunk_size=CHUNK, remat="full", old_from_new=True)
  upd = programs.lower_update(
    upd_plan, graphdef, train, _abstract_batch(b, t), loss_fn=obj, optimizer=optimizer,
    totals_fn=obj.totals,
  ).compile()  # fmt: skip
  return graphdef, score, upd, optimizer


def _time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _run_times(graphdef, score, upd, optimizer, t: int, b: int, repeats: int):
  params = nnx.state(model_lib.Decoder(MODEL, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, MODEL.vocab_size, (b, t)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  valid = jnp.ones((b, t), bool)
  ref_s = _time(lambda: score(params, tokens, positions, valid), repeats)
  f32 = jnp.zeros((b, t), jnp.float32)
  batch = batches.AdvantageBatch(
    tokens_BxT=tokens, positions_BxT=positions, valid_BxT=valid, loss_mask_BxT=valid,
    sampler_logps_BxT=f32, rewards_B=jnp.zeros((b,)), group_ids_B=jnp.zeros((b,), jnp.int32),
    token_rewards_BxT=f32, answer_bits_BxT=jnp.full((b, t), -1, jnp.int32),
    expert_bits_BxT=jnp.zeros((b, t), jnp.int32), ref_logps_BxT=f32,
    old_logps_BxT=f32, advantages_BxT=jnp.ones((b, t), jnp.float32), returns_BxT=f32,
  )  # fmt: skip

  def step():
    state = update.init_train_state(jax.tree.map(jnp.copy, params), optimizer, jax.random.key(0))
    return upd(state, batch)

  return ref_s, _time(step, repeats)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--time-max-t", type=int, default=4096, help="time programs up to this T")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  lengths = [int(x) for x in args.lengths.split(",")]
  print(hostmem.host_line())
  print(f"model {MODEL.num_layers} layers D={MODEL.embed_dim} H={MODEL.num_heads} "
        f"K={MODEL.num_kv_heads} Dh={MODEL.head_dim}, batch {args.batch}, block "
        f"{MODEL.attention_block}, backend {jax.default_backend()}, update remat=full")  # fmt: skip
  print("| T | impl | reference peak MiB | update peak MiB | reference s | update s |")
  print("|---|---|---|---|---|---|")
  peaks: dict[str, list[tuple[int, int, int]]] = {"naive": [], "chunked": []}
  for t in lengths:
    for impl in ("naive", "chunked"):
      graphdef, score, upd, optimizer = _programs(impl, t, args.batch)
      ref_peak, upd_peak = ex.MemoryStats.of(score).peak, ex.MemoryStats.of(upd).peak
      peaks[impl].append((t, ref_peak, upd_peak))
      times = ("-", "-")
      if t <= args.time_max_t:
        r, u = _run_times(graphdef, score, upd, optimizer, t, args.batch, args.repeats)
        times = (f"{r:.3f}", f"{u:.3f}")
      print(f"| {t} | {impl} | {ref_peak / 2**20:.1f} | {upd_peak / 2**20:.1f} | "
            f"{times[0]} | {times[1]} |", flush=True)  # fmt: skip
  for col, name in ((1, "reference"), (2, "update")):
    ts = np.array([p[0] for p in peaks["chunked"]], float)
    ys = np.array([p[col] for p in peaks["chunked"]], float)
    slope, icpt = np.polyfit(ts, ys, 1)
    resid = np.max(np.abs(ys - (slope * ts + icpt)) / ys)
    below = all(c[col] < n[col] for c, n in zip(peaks["chunked"], peaks["naive"]) if c[0] >= 2048)
    print(
      f"{name} chunked: peak ~= {icpt / 2**20:.1f} MiB + {slope:.0f} B/token x T (worst "
      f"relative residual {resid:.3f}); below naive for all T >= 2048: {below}"
    )


if __name__ == "__main__":
  main()
