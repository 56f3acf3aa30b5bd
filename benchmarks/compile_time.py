"""Compile time of the update program vs depth: scanned layers against unrolled ones.

Lowers and compiles the update program (PPO step, fwd + bwd + AdamW, no remat: a rematerialised
forward always scans) of a model of the same width at 2 and 24 layers, ``model.forward_layers``
scan and unrolled, from abstract shapes on one device, and prints the seconds (median of --repeats
fresh compilations; JAX's persistent compilation cache is switched off here, even where the
environment names one) and the 24/2 ratio.

  PYTHONPATH=. python benchmarks/compile_time.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
from flax import nnx

from benchmarks.attention import MODEL, _abstract_batch
from earl_jax import hostmem
from earl_jax import model as model_lib
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.rl import losses, objective, programs, update
from earl_jax.types import Stage

jax.config.update("jax_enable_compilation_cache", False)  # every compile is measured, not loaded


def compile_seconds(layers: int, scan: bool, t: int, b: int) -> float:
  cfg = dataclasses.replace(MODEL, num_layers=layers, forward_layers="scan" if scan else "unrolled")
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.Decoder(cfg, rngs=nnx.Rngs(0))))
  plan = make_stage_plan(Stage.UPDATE, [0], 1, 1, 1)
  optimizer = update.make_optimizer(update.OptimConfig())
  train = jax.eval_shape(lambda: update.init_train_state(state, optimizer, jax.random.key(0)))
  obj = objective.Objective(losses.LossConfig(), chunk_size=64, old_from_new=True)
  start = time.perf_counter()
  programs.lower_update(
    plan, graphdef, train, _abstract_batch(b, t), loss_fn=obj, optimizer=optimizer,
    totals_fn=obj.totals,
  ).compile()  # fmt: skip
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--batch", type=int, default=4)
  args = parser.parse_args()
  print(hostmem.host_line())
  print(f"update program, D={MODEL.embed_dim}, batch {args.batch} x {args.seq}, "
        f"backend {jax.default_backend()}")  # fmt: skip
  print("| layers | scan s | unrolled s |")
  print("|---|---|---|")
  out = {}
  for layers in (2, 24):
    for scan in (True, False):
      jax.clear_caches()
      runs = [compile_seconds(layers, scan, args.seq, args.batch) for _ in range(args.repeats)]
      out[layers, scan] = statistics.median(runs)
    print(f"| {layers} | {out[layers, True]:.2f} | {out[layers, False]:.2f} |", flush=True)
  print(f"24/2 layers: scan {out[24, True] / out[2, True]:.2f}x, "
        f"unrolled {out[24, False] / out[2, False]:.2f}x")  # fmt: skip


if __name__ == "__main__":
  main()
