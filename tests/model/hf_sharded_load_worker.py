"""One JAX process of hf_sharded_load_test: 4 CPU devices of a 2-process job on loopback.

Run as ``python hf_sharded_load_worker.py <port> <process_id> <checkpoint dir>``. Both processes
load the checkpoint onto one (fsdp=4, tensor=2) plan over all 8 devices, each reading only the
blocks of its own devices, and check them (and the logits) against a load onto one local device.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from flax import nnx  # noqa: E402

from earl_jax.model import Decoder, from_pretrained, hf_import, logits  # noqa: E402
from earl_jax.parallel import mesh as mesh_lib  # noqa: E402
from earl_jax.parallel.plan import make_stage_plan  # noqa: E402
from earl_jax.types import Stage  # noqa: E402


def main(port: str, process_id: int, ckpt: str) -> None:
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  plan = make_stage_plan(Stage.UPDATE, [d.id for d in jax.devices()], 1, 4, 2)
  cfg, _ = hf_import.read_config(ckpt)
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  shardings = mesh_lib.state_shardings(nnx.state(abstract), plan)
  with jax.transfer_guard_device_to_device("disallow_explicit"):
    model = hf_import.load_weights(ckpt, cfg, shardings)
  _, host = from_pretrained(ckpt)  # this process's first device, whole
  host_flat = dict(nnx.to_flat_state(nnx.state(host)))
  for path, var in nnx.to_flat_state(nnx.state(model)):
    arr = var.get_value()
    assert not arr.is_fully_addressable and len(arr.addressable_shards) == 4, path
    expected = np.asarray(host_flat[path].get_value())
    for shard in arr.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index], err_msg=path)
  print(f"ok {process_id} params", flush=True)

  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 11)).astype(np.int32)
  batch = mesh_lib.logical_to_sharding(("batch", None), tokens.shape, plan)
  global_tokens = jax.make_array_from_callback(tokens.shape, batch, lambda idx: tokens[idx])
  out = jax.jit(logits)(model, global_tokens)
  want = np.asarray(jax.jit(logits)(host, tokens))
  for shard in out.addressable_shards:
    np.testing.assert_allclose(np.asarray(shard.data), want[shard.index], atol=1e-5, rtol=0)
  print(f"ok {process_id} logits", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
