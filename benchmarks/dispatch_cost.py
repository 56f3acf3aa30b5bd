"""What planning one weight sync costs the host: Qwen2.5-72B, update -> rollout, 128 devices.

The dispatcher plans each leaf's route and (when asked, ``account=True``) its byte cost from the
shardings alone, in Python over every device's block. Both are cached per (source sharding,
target sharding, shape, dtype), so only the first sync of a layout pair pays. This times, for
every parameter leaf of the abstract 72B model (scanned layers: one stacked leaf per weight kind),
route + cost planning cold (caches cleared) and warm, on simulated CPU devices (nothing is
allocated: the shardings are all it needs).

  python benchmarks/dispatch_cost.py [--devices 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=128)
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  from flax import nnx

  from earl_jax import model as model_lib
  from earl_jax.parallel import dispatcher
  from earl_jax.parallel import mesh as mesh_lib
  from earl_jax.parallel.plan import make_stage_plan
  from earl_jax.parallel.presets import PRESETS
  from earl_jax.types import Stage

  cfg, ids = PRESETS["qwen2.5-72b"], range(args.devices)
  update = make_stage_plan(Stage.UPDATE, ids, -1, 16, 8)  # the 72B config's layouts
  rollout = make_stage_plan(Stage.ROLLOUT, ids, -1, 1, 4)
  abstract = nnx.state(nnx.eval_shape(lambda: model_lib.Decoder(cfg, rngs=nnx.Rngs(0))))
  src = jax.tree.leaves(mesh_lib.state_shardings(abstract, update))
  dst = jax.tree.leaves(mesh_lib.state_shardings(abstract, rollout))
  leaves = jax.tree.leaves(abstract)

  def plan_all() -> float:
    start = time.perf_counter()
    for x, s, d in zip(leaves, src, dst):
      shape, item = tuple(x.shape), x.dtype.itemsize
      route = dispatcher._route(s, d, shape, item)
      dispatcher._leaf_cost(s, d, shape, item, route)
    return time.perf_counter() - start

  dispatcher._route.cache_clear()
  dispatcher._leaf_cost.cache_clear()
  cold, warm = plan_all(), plan_all()
  big = max(leaves, key=lambda x: x.size)
  print(f"Qwen2.5-72B weight sync {update.describe()} -> {rollout.describe()}")
  print(f"{len(leaves)} leaves, {sum(x.size for x in leaves) / 1e9:.1f}B parameters; largest leaf")
  print(f"{tuple(big.shape)}\n")
  print("| route + byte cost planning | seconds (all leaves) |\n|---|---|")
  print(f"| first sync (cold caches) | {cold:.3f} |\n| every later sync (cached) | {warm:.6f} |")


if __name__ == "__main__":
  main()
