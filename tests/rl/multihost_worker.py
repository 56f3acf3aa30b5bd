"""One process of loop_multihost_test: 4 CPU devices of a 2-process training job on loopback.

Run as ``python multihost_worker.py <port> <process_id> <workdir> [<num_steps>]``; trains the tiny
test config (3 steps, evaluating at steps 0 and 2; with ``num_steps``: that many, no evaluation).
"""

import os
import pathlib
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from earl_jax import distributed  # noqa: E402
from earl_jax.rl import loop  # noqa: E402
from tests.rl.loop_test import tiny_config  # noqa: E402


def main(port: str, process_id: int, workdir: str, num_steps: int | None) -> None:
  distributed.initialize(f"127.0.0.1:{port}", 2, process_id, peer_timeout_s=10)
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  if num_steps is None:
    cfg = tiny_config(num_steps=3, eval_every=2)
  else:
    cfg = tiny_config(num_steps=num_steps, eval_every=0, checkpoint_every=1000)
  loop.Trainer(cfg, workdir).run()
  distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else None)
