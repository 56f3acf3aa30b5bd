"""Does token balancing of the update batch pay? The update step on a length-skewed batch, rows in
rollout order vs rows permuted so every data shard holds about as many real tokens.

earl_jax's stage programs are dense SPMD programs over padded [B, T] arrays: every shard computes
all of its B/n x T positions whatever their validity, so moving real tokens between shards should
not change the step time. This measures it: one update program (fwd + bwd + AdamW, data-parallel
over 8 CPU devices), the same batch in both row orders, interleaved repetitions, median and range.
The result is why the dispatcher does not balance tokens (its permutation support was removed).

  python benchmarks/balance.py [--batch 32 --length 512 --repeats 5]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
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
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.rl import programs, reference, stages, update
from earl_jax.types import Stage

CFG = ModelConfig(
  vocab_size=2048, embed_dim=256, mlp_dim=1024, num_layers=4, num_heads=8, num_kv_heads=8,
  head_dim=32, max_seq_len=4096,
)  # fmt: skip


def _loss(m: nnx.Module, batch: dict, totals) -> tuple[jax.Array, dict]:
  logps_BxT, _ = reference.token_logps(
    m, batch["tokens"], batch["positions"], batch["valid"], chunk_size=128
  )
  return -jnp.sum(logps_BxT * batch["valid"] * batch["adv"][:, None]) / totals, {}


def _totals(batch: dict) -> jax.Array:
  return jnp.maximum(jnp.sum(batch["valid"]), 1)


def balanced_order(lengths_B: np.ndarray, num_shards: int) -> np.ndarray:
  """Greedy longest-first: each row to the shard with the fewest tokens that still has room."""
  per_shard, members = len(lengths_B) // num_shards, [[] for _ in range(num_shards)]
  tokens = [0] * num_shards
  for i in np.argsort(-lengths_B, kind="stable"):
    room = [s for s in range(num_shards) if len(members[s]) < per_shard]
    shard = min(room, key=tokens.__getitem__)
    members[shard].append(int(i))
    tokens[shard] += int(lengths_B[i])
  return np.concatenate([np.asarray(m) for m in members])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--length", type=int, default=512)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args()
  print(hostmem.host_line())
  b, t, shards = args.batch, args.length, jax.device_count()
  plan = make_stage_plan(Stage.UPDATE, range(shards), shards, 1, 1)
  # Rollout order puts long episodes together: the first half of the rows are long.
  lengths = np.where(np.arange(b) < b // 2, t, t // 16)
  order = {"rollout order": np.arange(b), "balanced": balanced_order(lengths, shards)}
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, (b, t)).astype(np.int32)
  valid = np.arange(t)[None, :] < lengths[:, None]
  host = {
    "tokens": np.where(valid, tokens, 0),
    "positions": np.where(valid, np.arange(t, dtype=np.int32)[None, :], 0),
    "valid": valid,
    "adv": rng.standard_normal(b).astype(np.float32),
  }
  optimizer = update.make_optimizer(update.OptimConfig())
  model = mesh_lib.create_sharded(lambda: model_lib.Decoder(CFG, rngs=nnx.Rngs(0)), plan)
  graphdef, params = nnx.split(model)
  state = update.init_train_state(params, optimizer, jax.random.key(0))
  state = jax.device_put(state, ex.train_state_shardings(plan, state, optimizer))
  shardings = stages.batch_shardings(plan, host)
  batches = {k: jax.device_put({n: v[o] for n, v in host.items()}, shardings)
             for k, o in order.items()}  # fmt: skip
  abstract_batch = jax.eval_shape(lambda: batches["balanced"])
  abstract_state = jax.eval_shape(lambda: state)
  program = programs.lower_update(
    plan, graphdef, abstract_state, abstract_batch, loss_fn=_loss, optimizer=optimizer,
    totals_fn=_totals,
  ).compile()  # fmt: skip
  times = {k: [] for k in order}
  for r in range(args.repeats + 1):  # round 0: warm-up
    for k in order:
      start = time.perf_counter()
      state, _ = program(state, batches[k])
      jax.block_until_ready(state)
      if r:
        times[k].append(time.perf_counter() - start)
  per_shard = lambda o: lengths[o].reshape(shards, -1).sum(1)  # noqa: E731
  print(f"update step, B={b} T={t}, {shards} data shards, {jax.device_count()} CPU devices, "
        f"model {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params")  # fmt: skip
  print("\n| rows | real tokens per shard (min-max) | step s median [min-max] |")
  print("|---|---|---|")
  for k, o in order.items():
    ts, tok = times[k], per_shard(o)
    print(f"| {k} | {tok.min()}-{tok.max()} | {statistics.median(ts):.3f} "
          f"[{min(ts):.3f}-{max(ts):.3f}] |")  # fmt: skip
  ratio = statistics.median(times["rollout order"]) / statistics.median(times["balanced"])
  print(f"\nrollout order / balanced = {ratio:.3f}")


if __name__ == "__main__":
  main()
