"""The dispatcher across 2 JAX processes x 4 CPU devices on loopback (gloo collectives)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

_WORKER = Path(__file__).with_name("multiprocess_worker.py")
_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_dispatch_between_plans_spanning_two_processes():
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(_ROOT)
  procs = [
    subprocess.Popen(
      [sys.executable, str(_WORKER), str(port), str(i)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=240)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    assert sum(line.startswith(f"ok {i} ") for line in out.splitlines()) == 6, out[-4000:]
