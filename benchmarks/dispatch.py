"""Dispatcher vs the centralized (single-controller) baseline on RL intermediate data.

Moves batches shaped like the paper's intermediate data (tokens, masks, log-probs, values for B
sequences of L tokens) from the rollout layout to the update layout, once with the earl_jax
dispatcher and once through process 0's host, and prints a markdown table.

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
  p.add_argument("--repeats", type=int, default=3, help="timed runs per cell (best is shown)")
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


def _run(args: argparse.Namespace) -> None:
  import jax

  from earl_jax.parallel import dispatcher
  from earl_jax.parallel import mesh as mesh_lib
  from earl_jax.parallel import plan as plan_lib
  from earl_jax.types import Stage

  ids = [d.id for d in jax.devices()]
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
      best = {}
      for mode in ("direct", "centralized"):
        dispatcher.dispatch(batch, dst, mode=mode)  # warm-up: compiles the jitted routes
        runs = [dispatcher.dispatch(batch, dst, mode=mode)[1] for _ in range(args.repeats)]
        best[mode] = min(runs, key=lambda s: s.seconds)
      rows.append((name, length, best["direct"], best["centralized"]))
  if jax.process_index() == 0:
    _print_table(args, rows)


_KEYS = ("tokens", "mask", "logprobs", "values")


def _print_table(args: argparse.Namespace, rows: list) -> None:
  mib = 2.0**20
  print(f"\n{args.num_processes} process(es), B={args.batch}, best of {args.repeats}\n")
  print(
    "| layout | L | MiB | direct s | centralized s | ratio | host MiB direct / central "
    "| busiest process MiB direct / central | direct routes |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for name, length, d, c in rows:
    print(
      f"| {name} | {length} | {d.bytes_total / mib:.1f} | {d.seconds:.4f} | {c.seconds:.4f} | "
      f"{c.seconds / d.seconds:.2f} | {d.bytes_through_host / mib:.1f} / "
      f"{c.bytes_through_host / mib:.1f} | {d.bytes_busiest_process / mib:.1f} / "
      f"{c.bytes_busiest_process / mib:.1f} | {','.join(sorted(d.route_counts()))} |"
    )


def main() -> int:
  args = _parse()
  if args.num_processes not in (1, 2, 4, 8):
    raise SystemExit(f"--num-processes={args.num_processes}; allowed: 1, 2, 4, 8")
  if args.num_processes > 1 and args.process_id < 0:
    return _relaunch(args)
  _setup(args)
  start = time.perf_counter()
  _run(args)
  if args.process_id <= 0:
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
