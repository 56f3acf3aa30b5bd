"""One JAX process of dispatcher_multiprocess_test: 4 CPU devices of a 2-process job on loopback.

Run as ``python multiprocess_worker.py <port> <process_id>``; prints one line per checked case.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from earl_jax.parallel import dispatcher  # noqa: E402
from earl_jax.parallel import mesh as mesh_lib  # noqa: E402
from earl_jax.parallel import plan as plan_lib  # noqa: E402
from earl_jax.types import BATCH, MLP, Stage  # noqa: E402

CASES = [  # (name, src device positions, src mesh, dst device positions, dst mesh)
  ("span->span relayout", range(8), (1, 4, 2), range(8), (2, 1, 4)),
  ("span->span reversed", range(8), (1, 4, 2), list(reversed(range(8))), (2, 1, 4)),
  ("span->process0", range(8), (1, 4, 2), range(4), (2, 1, 2)),
  ("process0->span", range(4), (1, 2, 2), range(8), (2, 1, 4)),
  ("process0->process1", range(4), (1, 2, 2), range(4, 8), (1, 1, 4)),
  ("process1->process0 same layout", range(4, 8), (1, 2, 2), range(4), (1, 2, 2)),
]


def main(port: str, process_id: int) -> None:
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  host_BxF = np.random.default_rng(7).standard_normal((16, 24)).astype(np.float32)
  ids = [d.id for d in jax.devices()]  # CPU ids are not contiguous across processes (0.., 2048..)
  for name, src_pos, src_mesh, dst_pos, dst_mesh in CASES:
    src_plan = plan_lib.make_stage_plan(Stage.UPDATE, [ids[i] for i in src_pos], *src_mesh)
    dst_plan = plan_lib.make_stage_plan(Stage.ROLLOUT, [ids[i] for i in dst_pos], *dst_mesh)
    src = mesh_lib.logical_to_sharding((BATCH, None), host_BxF.shape, src_plan)
    dst = mesh_lib.logical_to_sharding((BATCH, MLP), host_BxF.shape, dst_plan)
    x = jax.make_array_from_callback(
      host_BxF.shape, src, lambda idx: host_BxF[idx], dtype=host_BxF.dtype
    )
    with jax.transfer_guard("disallow_explicit"):
      (y,), stats = dispatcher.dispatch([x], [dst])
    assert y.sharding == dst, (name, y.sharding, dst)
    for shard in y.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), host_BxF[shard.index], err_msg=name)
    assert stats.bytes_through_host == 0
    # The centralized baseline too: every process must enter its all-gather, also one that
    # holds no block of the source (process0->process1 once hung process 1 there).
    (z,), central = dispatcher.dispatch([x], [dst], mode="centralized")
    for shard in z.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), host_BxF[shard.index], err_msg=name)
    assert central.bytes_through_host > 0
    print(
      f"ok {process_id} {name} {stats.routes[0][1]} shards={len(y.addressable_shards)}", flush=True
    )
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
