"""The benchmarks still run against the current APIs (smallest shapes; no figures are checked).

The selector benchmark once broke silently when the loss signature changed; these keep every
benchmark's code paths exercised in CI at a cost of seconds.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import balance
from benchmarks import selector as selector_bench
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.types import Stage

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dispatch_benchmark_prints_both_tables():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  cmd = [
    sys.executable,
    "benchmarks/dispatch.py",
    "--lengths",
    "64",
    "--batch",
    "8",
    "--repeats",
    "1",
  ]
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "(1) paper-shaped batches" in out.stdout and "(2) the trainer's moves" in out.stdout
  assert "weight sync update -> rollout" in out.stdout


@pytest.mark.parametrize("stage", list(Stage))
def test_selector_benchmark_runs_each_stage_with_micro_batches(stage):
  bench = selector_bench.Bench(repeats=1)
  fixed = selector_bench._fixed(stage, 8)
  # Fixed plans get the selector's micro-batch options too.
  assert {p.micro_batch_size for p in fixed} == {0, 4}
  plan = make_stage_plan(stage, range(8), 2, 1, 4, micro_batch_size=4)
  length = selector_bench.CHUNK  # the smallest length the chunked log-probs take
  bench.run(plan, 8, length)
  assert bench.peak(plan, 8, length) > 0


def test_balance_benchmark_order_balances_tokens():
  lengths = [512] * 16 + [32] * 16
  order = balance.balanced_order(np.asarray(lengths), 8)
  per_shard = [sum(lengths[i] for i in order[s * 4 : (s + 1) * 4]) for s in range(8)]
  assert sorted(order.tolist()) == list(range(32)) and max(per_shard) == min(per_shard)


@pytest.mark.slow
def test_peers_benchmark_checks_parity_then_prints_the_table():
  """The tiny size, every kind of work, 1 and 2 devices: the parity checks pass before timing."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "benchmarks/peers.py", "--sizes", "tiny", "--devices", "1,2"]
  cmd += ["--new_tokens", "8", "--repeats", "1", "--pause", "0", "--threads", "1"]
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "update B32 T288: update step 1, 2 device(s): loss" in out.stdout
  # The same step in micro-batches (gradients accumulated on both sides): checked alike.
  assert "micro-batches of 8: update step 1, 2 device(s): loss" in out.stdout
  assert "allocator in every worker: " in out.stdout  # checked in each worker's memory map
  assert f"{os.cpu_count()} cores (" in out.stdout  # the header names the CPU
  assert "## tiny: 0.09M parameters" in out.stdout  # counted on the loaded model
  rows = ("generate B32 +8", "reference B32 T288", "update B32 T288 (", "update B32 T288, micro")
  for row in rows:
    assert f"| {row}" in out.stdout


@pytest.mark.slow
def test_rollout_benchmark_prints_longtail_serving_and_config_tables():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [
    sys.executable, "benchmarks/rollout.py", "--width", "64", "--layers", "1", "--slots", "4",
    "--episodes", "6", "--max-new", "16", "--stop-p", "0.2", "--latencies", "0",
    "--requests", "4", "--serve-tokens", "8", "--repeats", "1",
    "--set", "rl.num_groups=2", "--set", "rollout.num_slots=8", "--set", "rollout.max_turns=6",
  ]  # fmt: skip
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  for line in ("continuous / turn (tokens/s)", "| gRPC / direct |", "| continuous |"):
    assert line in out.stdout, out.stdout
  assert "rl.num_groups=2, rollout.num_slots=8" in out.stdout  # --set reached the config
  # Every timed run was warmed up with its own key: no compile is part of a figure.
  assert out.stdout.count("compilations during the timed runs: 0") == 2, out.stdout
