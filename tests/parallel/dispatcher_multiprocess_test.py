"""The dispatcher across 2 JAX processes x 4 CPU devices on loopback (gloo collectives)."""

from pathlib import Path

import pytest

from tests.multiprocess import run_workers

_WORKER = Path(__file__).with_name("multiprocess_worker.py")


@pytest.mark.slow
def test_dispatch_between_plans_spanning_two_processes():
  results = run_workers(_WORKER)
  for i, (returncode, out) in enumerate(results):
    assert returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    assert sum(line.startswith(f"ok {i} ") for line in out.splitlines()) == 6, out[-4000:]
