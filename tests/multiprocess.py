"""Launching N local JAX processes for the multi-process tests: a free coordinator port, and the
workers run to completion (killed if one hangs), each one's exit status and output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_workers(
  worker: Path, *args: str, n: int = 2, timeout: float = 240
) -> list[tuple[int, str]]:
  """``python worker PORT I *args`` for I in 0..n-1 (no simulated-device flags: each worker sets
  its own), all at once; [(exit status, output)] in process order."""
  port = str(free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT)
  procs = [
    subprocess.Popen(
      [sys.executable, str(worker), port, str(i), *args],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(n)
  ]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [(p.returncode, out) for p, out in zip(procs, outputs)]
