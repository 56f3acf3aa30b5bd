"""A 2-process (multi-host) training run on loopback agrees with the single-process run."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

from earl_jax import metrics as metrics_lib
from earl_jax.rl import loop
from tests.rl.loop_test import _stable, tiny_config

_WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


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
