"""Dispatcher vs the centralized (single-controller) baseline, side by side in one run.

(1) Batches shaped like the paper's intermediate data (tokens, masks, log-probs, values for B
    sequences of L tokens), rollout layout -> update layout.
(2) The moves the trainer makes every step, on the 72B config's layouts scaled to 8 devices
    (rollout data 2 x tensor 4, reference tensor 8, update fsdp 4 x tensor 2): the host-built
    rollout batch uploaded to the reference layout (the same upload in both modes: the env loop
    lives on the host), the scored batch (an AdvantageBatch) reference -> update, the weight sync
    update -> rollout and policy -> reference (pi_old scoring), for a ~34M-parameter Qwen2-shaped
    model (hidden 512, 8 layers, vocab 8192, f32).

The centralized baseline is what a single controller does: ``jax.device_get`` (one replica per
block) then a scatter to the target blocks. Host bytes are counted as they are copied (the
baseline's fetches and scatters; the direct mode runs with host transfers disallowed, so its
count is the uploaded metadata only, and a host fallback would raise). Device bytes and transfers
come from the shardings. Seconds: median of --repeats after a warm-up, both modes alternating.

  python benchmarks/dispatch.py                       # one process, 8 CPU devices
  python benchmarks/dispatch.py --num-processes 4     # 4 loopback processes x 2 devices (gloo)

CPU "devices" share RAM, so seconds do not show the network effect; the byte columns (through the
host, through the busiest process) are the hardware-independent figures.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--lengths", default="1024,4096,16384,32768", help="comma-separated L values")
  p.add_argument("--batch", type=int, default=32, help="sequences B (divisible by 4)")
  p.add_argument("--repeats", type=int, default=5, help="timed runs per cell (median shown)")
  p.add_argument("--num-processes", type=int, default=1, help="loopback JAX processes (1,2,4,8)")
  p.add_argument("--process-id", type=int, default=-1, help=argparse.SUPPRESS)
  p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
  return p.parse_args()


def _relaunch(args: argparse.Namespace) -> int:
  """Starts N copies of this script as the processes of one JAX job; returns the worst rc."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  base = [sys.executable, __file__, "--lengths", args.lengths, "--batch", str(args.batch)]
  base += ["--repeats", str(args.repeats), "--num-processes", str(args.num_processes)]
  procs = [
    subprocess.Popen([*base, "--process-id", str(i), "--port", str(port)])
    for i in range(args.num_processes)
  ]
  return max(p.wait(timeout=1800) for p in procs)


def _setup(args: argparse.Namespace) -> None:
  per_process = 8 // args.num_processes
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per_process}"
  import jax

  if args.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      f"127.0.0.1:{args.port}", num_processes=args.num_processes, process_id=args.process_id
    )


def _batch(b: int, length: int, shardings: dict) -> dict:
  import jax
  import numpy as np

  rng = np.random.default_rng(length)
  host = {
    "tokens": rng.integers(0, 32000, (b, length), dtype=np.int32),
    "mask": rng.random((b, length)) < 0.7,
    "logprobs": rng.standard_normal((b, length)).astype(np.float32),
    "values": rng.standard_normal((b, length)).astype(np.float32),
  }
  return {
    k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i], dtype=v.dtype)
    for k, v in host.items()
  }


def _measure(tree, dst, repeats: int) -> dict:
  """Median seconds per mode over ``repeats`` alternating runs (after one warm-up each)."""
  import statistics

  from earl_jax.parallel import dispatcher

  runs = {"direct": [], "centralized": []}
  for mode in runs:  # warm-up: compiles the jitted routes
    dispatcher.dispatch(tree, dst, mode=mode, measure=True)
  for _ in range(repeats):
    for mode in runs:
      runs[mode].append(dispatcher.dispatch(tree, dst, mode=mode, account=True, measure=True)[1])
  out = {}
  for mode, stats in runs.items():
    out[mode] = stats[0]
    out[mode + "_s"] = statistics.median(s.seconds for s in stats)
  return out


def _paper_moves(args: argparse.Namespace, ids: list[int]) -> list:
  from earl_jax.parallel import mesh as mesh_lib
  from earl_jax.parallel import plan as plan_lib
  from earl_jax.types import Stage

  scenarios = {  # name: (rollout plan, update plan)
    "colocated": (
      plan_lib.make_stage_plan(Stage.ROLLOUT, ids, 2, 1, 4),
      plan_lib.make_stage_plan(Stage.UPDATE, ids, 1, 4, 2),
    ),
    "split": (
      plan_lib.make_stage_plan(Stage.ROLLOUT, ids[:4], 2, 1, 2),
      plan_lib.make_stage_plan(Stage.UPDATE, ids[4:], 1, 4, 1),
    ),
  }
  rows = []
  for name, (src_plan, dst_plan) in scenarios.items():
    for length in (int(x) for x in args.lengths.split(",")):
      src = {k: mesh_lib.batch_sharding(src_plan, 2, args.batch) for k in _KEYS}
      dst = {k: mesh_lib.batch_sharding(dst_plan, 2, args.batch) for k in _KEYS}
      batch = _batch(args.batch, length, src)
      rows.append((f"{name} L={length}", _measure(batch, dst, args.repeats)))
  return rows


def _trainer_moves(args: argparse.Namespace, ids: list[int]) -> list:
  import statistics

  import jax
  import numpy as np
  from flax import nnx

  from earl_jax import model as model_lib
  from earl_jax.model.config import ModelConfig
  from earl_jax.parallel import dispatcher
  from earl_jax.parallel import mesh as mesh_lib
  from earl_jax.parallel import plan as plan_lib
  from earl_jax.rl import batches, stages
  from earl_jax.types import Stage

  rollout = plan_lib.make_stage_plan(Stage.ROLLOUT, ids, 2, 1, 4)
  reference = plan_lib.make_stage_plan(Stage.REFERENCE, ids, 1, 1, 8)
  update = plan_lib.make_stage_plan(Stage.UPDATE, ids, 1, 4, 2)
  b, t = args.batch, int(args.lengths.split(",")[-1])
  rng = np.random.default_rng(0)
  bt = lambda dtype: (rng.standard_normal((b, t)) * 3).astype(dtype)  # noqa: E731
  host = batches.AdvantageBatch(
    tokens_BxT=bt(np.int32), positions_BxT=bt(np.int32), valid_BxT=bt(np.float32) > 0,
    loss_mask_BxT=bt(np.float32) > 0, sampler_logps_BxT=bt(np.float32),
    rewards_B=rng.standard_normal(b).astype(np.float32), group_ids_B=np.arange(b, dtype=np.int32),
    token_rewards_BxT=bt(np.float32), answer_bits_BxT=bt(np.int32), expert_bits_BxT=bt(np.int32),
    ref_logps_BxT=bt(np.float32), old_logps_BxT=bt(np.float32),
    advantages_BxT=bt(np.float32), returns_BxT=bt(np.float32),
  )  # fmt: skip
  rows = []
  # The host-built rollout batch onto the reference layout, counted as the blocks are uploaded
  # (the centralized mode's own scatter).
  counter, times = dispatcher._HostCounter(), []
  for _ in range(args.repeats + 1):
    start = time.perf_counter()
    scored = jax.tree.map(counter.scatter, host, stages.batch_shardings(reference, host))
    jax.block_until_ready(scored)
    times.append(time.perf_counter() - start)
  per_run = counter.bytes // (args.repeats + 1)
  rows.append(("rollout batch (host) -> reference", per_run, statistics.median(times[1:])))
  upd_sh = stages.batch_shardings(update, host)
  name = f"scored batch reference -> update (B={b}, T={t})"
  rows.append((name, _measure(scored, upd_sh, args.repeats)))
  cfg = ModelConfig(
    vocab_size=8192, embed_dim=512, mlp_dim=1536, num_layers=8, num_heads=8, num_kv_heads=8,
    head_dim=64,
  )  # fmt: skip
  model = mesh_lib.create_sharded(lambda: model_lib.Decoder(cfg, rngs=nnx.Rngs(0)), update)
  params = nnx.state(model)
  syncs = (("weight sync update -> rollout", rollout), ("policy -> reference", reference))
  for name, plan in syncs:
    dst = mesh_lib.state_shardings(params, plan)
    rows.append((name, _measure(params, dst, args.repeats)))
  return rows


def _run(args: argparse.Namespace) -> None:
  import jax

  ids = [d.id for d in jax.devices()]
  paper = _paper_moves(args, ids)
  trainer = _trainer_moves(args, ids)
  if jax.process_index() == 0:
    _print_table(args, paper, trainer)


_KEYS = ("tokens", "mask", "logprobs", "values")


def _print_table(args: argparse.Namespace, paper: list, trainer: list) -> None:
  mib = 2.0**20
  head = (
    "| move | MiB | direct s | centralized s | centralized / direct | host MiB direct / central "
    "| busiest process MiB direct / central | device transfers direct | direct routes |"
  )
  print(f"\n{args.num_processes} process(es), B={args.batch}, median of {args.repeats}")
  for title, rows in (("(1) paper-shaped batches", paper), ("(2) the trainer's moves", trainer)):
    print(f"\n{title}\n\n{head}\n|---|---|---|---|---|---|---|---|---|")
    for name, *cell in rows:
      if len(cell) == 2:  # the upload: same in both modes
        nbytes, seconds = cell
        print(f"| {name} | {nbytes / mib:.1f} | {seconds:.4f} | same | 1.00 | "
              f"{nbytes / mib:.1f} / {nbytes / mib:.1f} (upload) | - | - | host |")  # fmt: skip
        continue
      (m,) = cell
      d, c = m["direct"], m["centralized"]
      routes = ",".join(sorted(d.route_counts()))
      print(
        f"| {name} | {d.bytes_total / mib:.1f} | {m['direct_s']:.4f} | {m['centralized_s']:.4f} | "
        f"{m['centralized_s'] / m['direct_s']:.2f} | {d.bytes_through_host / mib:.2f} / "
        f"{c.bytes_through_host / mib:.1f} | {d.bytes_busiest_process / mib:.1f} / "
        f"{c.bytes_busiest_process / mib:.1f} | {d.num_transfers} | {routes} |"
      )


def main() -> int:
  args = _parse()
  if args.num_processes not in (1, 2, 4, 8):
    raise SystemExit(f"--num-processes={args.num_processes}; allowed: 1, 2, 4, 8")
  if args.num_processes > 1 and args.process_id < 0:
    return _relaunch(args)
  _setup(args)
  if args.process_id <= 0:
    from earl_jax import hostmem

    print(hostmem.host_line())
  start = time.perf_counter()
  _run(args)
  if args.process_id <= 0:
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
