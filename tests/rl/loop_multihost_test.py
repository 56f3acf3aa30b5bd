"""A 2-process (multi-host) training run on loopback agrees with the single-process run."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from earl_jax import distributed
from earl_jax import metrics as metrics_lib
from earl_jax.rl import loop
from tests.rl.loop_test import _stable, tiny_config

_WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
_PEER_TIMEOUT_S = 10  # the worker's distributed.initialize(peer_timeout_s=...)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_run_agrees_with_single_process(tmp_path):
  port, workdir = str(_free_port()), tmp_path / "multi"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
    subprocess.Popen([sys.executable, str(_WORKER), port, str(i), str(workdir)], env=env)
    for i in range(2)
  ]
  try:
    codes = [p.wait(timeout=600) for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert codes == [0, 0]
  single = loop.Trainer(tiny_config(num_steps=3, eval_every=2), tmp_path / "single").run()
  multi = metrics_lib.read_metrics(workdir)
  other = metrics_lib.read_metrics(workdir / "process_1")
  assert [r["step"] for r in multi] == [0, 1, 2] == [r["step"] for r in single]
  assert _stable(multi) == _stable(other)  # both controllers saw the same run
  for m, s in zip(_stable(multi), _stable(single)):
    assert m.keys() == s.keys()
    for key, value in s.items():
      assert m[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (m["step"], key)


def _start_two(workdir: pathlib.Path, num_steps: int) -> list[subprocess.Popen]:
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return [
    subprocess.Popen(
      [sys.executable, str(_WORKER), port, str(i), str(workdir), str(num_steps)],
      env=env,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]


def _wait_for_step(workdir: pathlib.Path, step: int, procs, timeout_s: float = 600) -> None:
  deadline = time.monotonic() + timeout_s
  rows = workdir / "process_1" / "metrics.jsonl"
  while time.monotonic() < deadline:
    if rows.exists() and len(rows.read_text().splitlines()) > step:
      return
    assert all(p.poll() is None for p in procs), "a process ended before the fault"
    time.sleep(0.1)
  raise TimeoutError(f"step {step} not reached")


def _finish(procs, timeout_s: float = 120) -> tuple[list[int | None], list[str], float]:
  """Exit codes (None: still running at the deadline, then killed), stderr and seconds taken."""
  start, errs = time.monotonic(), []
  for p in procs:
    try:
      errs.append(p.communicate(timeout=max(1.0, start + timeout_s - time.monotonic()))[1])
    except subprocess.TimeoutExpired:
      p.kill()
      errs.append(p.communicate()[1] + "\n<killed at the deadline>")
  codes = [
    p.returncode if not e.endswith("<killed at the deadline>") else None
    for p, e in zip(procs, errs)
  ]
  return codes, errs, time.monotonic() - start


@pytest.mark.slow
def test_sigterm_to_one_process_saves_one_checkpoint_and_all_exit_cleanly(tmp_path):
  procs = _start_two(tmp_path, num_steps=50)
  _wait_for_step(tmp_path, 1, procs)
  procs[1].send_signal(signal.SIGTERM)
  codes, _, seconds = _finish(procs)
  assert codes == [0, 0]
  saved = [int(s) for s in os.listdir(tmp_path / "checkpoints")]
  last = max(saved)
  assert 1 <= last < 49  # the step both processes agreed on, not the end of the run
  steps = [
    [r["step"] for r in metrics_lib.read_metrics(d)] for d in (tmp_path, tmp_path / "process_1")
  ]
  assert steps[0] == steps[1] == list(range(last + 1))
  print(f"SIGTERM to process 1: both exited 0 after {seconds:.1f} s, checkpoint step {last}")


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_peer_ends_the_survivor_with_a_clear_error_in_bounded_time(tmp_path, victim):
  procs = _start_two(tmp_path, num_steps=50)
  _wait_for_step(tmp_path, 1, procs)
  procs[victim].send_signal(signal.SIGKILL)
  codes, errs, seconds = _finish(procs, timeout_s=_PEER_TIMEOUT_S + 30)
  survivor = 1 - victim
  tail = errs[survivor][-3000:]
  assert codes[victim] == -signal.SIGKILL
  if victim == 1:  # the watchdog: one line and EXIT_PEER_LOST
    assert codes[survivor] == distributed.EXIT_PEER_LOST, tail
    assert "earl_jax: process 0 stops: lost process 1 of the run" in errs[survivor], tail
  else:  # the coordinator: JAX's runtime aborts at once, naming the lost leader
    assert codes[survivor] not in (0, None), tail
    assert "leader task was preempted/died" in errs[survivor], tail
  assert seconds < _PEER_TIMEOUT_S + 10
  print(f"SIGKILL of process {victim}: survivor exit {codes[survivor]} after {seconds:.1f} s")
