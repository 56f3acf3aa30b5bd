"""One process of loop_multihost_test: 4 CPU devices of a 2-process training job on loopback.

Run as ``python multihost_worker.py <port> <process_id> <workdir>``; trains the tiny test config.
"""

import os
import pathlib
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from earl_jax.rl import loop  # noqa: E402
from tests.rl.loop_test import tiny_config  # noqa: E402


def main(port: str, process_id: int, workdir: str) -> None:
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  loop.Trainer(tiny_config(num_steps=3, eval_every=2), workdir).run()
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
