"""Tests of earl_jax.checkpoint: round trips across meshes, cadence, errors, SIGTERM and SIGKILL."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax import checkpoint as checkpoint_lib
from earl_jax import preemption

_REPO = pathlib.Path(__file__).resolve().parent.parent


def _mesh(shape: tuple[int, int], devices: list | None = None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  return Mesh(np.array(devices).reshape(shape), ("fsdp", "tensor"))


def _state(mesh: Mesh) -> dict:
  """A small train state with distinct dims, a bf16 leaf, optax NamedTuples and a typed key."""
  params = {
    "embed": jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) / 7.0,
    "layers": [{"w": jnp.linspace(-1.0, 1.0, 4 * 10).reshape(4, 10).astype(jnp.bfloat16)}],
  }
  specs = {"embed": P("fsdp", "tensor"), "layers": [{"w": P(None, "tensor")}]}
  params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
  opt_state = optax.adam(1e-3).init(params)
  return {
    "params": params,
    "opt": opt_state,
    "rng": jax.random.key(42),
    "legacy_rng": jax.random.PRNGKey(7),
    "step": jnp.int32(3),
  }


def _abstract(state: dict, sharding_fn) -> dict:
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)),
    jax.eval_shape(lambda: state),
  )


def _assert_bit_equal(a: dict, b: dict) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert x.dtype == y.dtype
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.requires_devices(8)
@pytest.mark.parametrize("target", ["mesh_1x8", "subset_2x2"])
def test_restore_onto_other_mesh_is_bit_equal_with_requested_shardings(tmp_path, target):
  state = _state(_mesh((4, 2)))
  meta = {"data_position": 17, "plan": {"rollout": [4, 2]}, "note": "hi"}
  with checkpoint_lib.Checkpointer(tmp_path / "ckpt", save_every=1, keep=2) as ckpt:
    assert ckpt.save(3, state=state, meta=meta)
    ckpt.wait()
    mesh = _mesh((1, 8)) if target == "mesh_1x8" else _mesh((2, 2), jax.devices()[:4])

    def sharding_fn(x: jax.ShapeDtypeStruct) -> NamedSharding:
      # Shard the last dim over 'tensor' where it divides, else replicate.
      ok = x.ndim >= 1 and x.shape[-1] % mesh.shape["tensor"] == 0
      return NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "tensor") if ok else P())

    abstract = _abstract(state, sharding_fn)
    restored, restored_meta = ckpt.restore(abstract_state=abstract)
  _assert_bit_equal(state, restored)
  assert restored_meta == meta
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
    assert got.sharding == want.sharding
  assert restored["rng"].dtype == jax.random.key(0).dtype
  # The restored key draws the same numbers as the original.
  np.testing.assert_array_equal(
    jax.random.normal(restored["rng"], (5,)), jax.random.normal(state["rng"], (5,))
  )


def test_cadence_keep_and_existing_step(tmp_path):
  one = NamedSharding(_mesh((1, 1), jax.devices()[:1]), P())
  ckpt = checkpoint_lib.Checkpointer(tmp_path, save_every=2, keep=2, async_save=False)
  saved = [s for s in range(1, 8) if ckpt.save(s, state={"x": jnp.full((3,), s)}, meta={"s": s})]
  assert saved == [2, 4, 6]
  assert ckpt.save(7, state={"x": jnp.full((3,), 7)}, meta={"s": 7}, force=True)
  assert ckpt.save(7, state={"x": jnp.zeros(3)}, meta={}, force=True) is False  # already on disk
  assert ckpt.all_steps() == [6, 7]
  assert ckpt.latest_step() == 7
  abstract = {"x": jax.ShapeDtypeStruct((3,), jnp.int32, sharding=one)}
  state, meta = ckpt.restore(6, abstract_state=abstract)
  np.testing.assert_array_equal(state["x"], [6, 6, 6])
  assert meta == {"s": 6}
  ckpt.close()
  # A second Checkpointer on the same directory sees the same steps (resume).
  again = checkpoint_lib.Checkpointer(tmp_path, save_every=2, keep=2)
  assert again.latest_step() == 7
  assert again.restore(abstract_state=abstract)[1] == {"s": 7}
  again.close()


def test_async_save_owns_its_copy_so_the_caller_may_donate(tmp_path):
  one = NamedSharding(_mesh((1, 1), jax.devices()[:1]), P())
  x = jax.device_put(jnp.arange(50_000, dtype=jnp.float32), one)
  with checkpoint_lib.Checkpointer(tmp_path, save_every=1, keep=1) as ckpt:
    assert ckpt.save(1, state={"x": x}, meta={})
    x.delete()  # what donating the buffer to the next step does
    ckpt.wait()
    abstract = {"x": jax.ShapeDtypeStruct((50_000,), jnp.float32, sharding=one)}
    state, _ = ckpt.restore(abstract_state=abstract)
  np.testing.assert_array_equal(state["x"], np.arange(50_000, dtype=np.float32))


def test_errors_are_clear(tmp_path):
  one = NamedSharding(_mesh((1, 1), jax.devices()[:1]), P())
  abstract = {"x": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=one)}
  empty = checkpoint_lib.Checkpointer(tmp_path / "empty", save_every=1, keep=1)
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
    empty.restore(abstract_state=abstract)
  assert empty.latest_step() is None
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(NotADirectoryError, match="not a directory"):
    checkpoint_lib.Checkpointer(a_file, save_every=1, keep=1)
  with pytest.raises(ValueError, match="save_every"):
    checkpoint_lib.Checkpointer(tmp_path / "c", save_every=0, keep=1)

  ckpt = checkpoint_lib.Checkpointer(tmp_path / "c", save_every=1, keep=1, async_save=False)
  with pytest.raises(TypeError, match="JSON"):
    ckpt.save(1, state={"x": jnp.zeros(3)}, meta={"bad": object()})
  ckpt.save(1, state={"x": jnp.zeros(3)}, meta={})
  with pytest.raises(FileNotFoundError, match=r"step 5 .*available steps: \[1\]"):
    ckpt.restore(5, abstract_state=abstract)
  wrong = {"x": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=one), "y": abstract["x"]}
  with pytest.raises(ValueError, match=r"not in the checkpoint: \['y'\].*x: saved float32\[3\]"):
    ckpt.restore(abstract_state=wrong)
  with pytest.raises(ValueError, match="has no sharding"):
    ckpt.restore(abstract_state={"x": jax.ShapeDtypeStruct((3,), jnp.float32)})
  ckpt.close()


def test_preemption_flag_in_process():
  seen = []
  uninstall = preemption.install_preemption_handler(seen.append)
  try:
    assert not preemption.preempted()
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.preempted()
    assert seen == [signal.SIGTERM]
  finally:
    uninstall()
  assert not preemption.preempted()
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_first_ctrl_c_asks_to_stop_and_the_second_quits_at_once():
  previous = signal.getsignal(signal.SIGINT)
  uninstall = preemption.install_preemption_handler(signals=(signal.SIGTERM, signal.SIGINT))
  try:
    os.kill(os.getpid(), signal.SIGINT)
    assert preemption.preempted() and preemption.received() == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)  # the handler runs between bytecodes; it raises before this ends
  finally:
    uninstall()
  assert signal.getsignal(signal.SIGINT) is previous and preemption.received() == ""


_CHILD_PRELUDE = """
import json, os, signal, sys, time
import jax, jax.numpy as jnp
from earl_jax import checkpoint as checkpoint_lib
from earl_jax import preemption
ckpt = checkpoint_lib.Checkpointer(sys.argv[1], save_every=1000, keep=3)
def state(step):
  w = jnp.full((256, 256), float(step))
  return {"w": w, "step": jnp.int32(step), "rng": jax.random.key(step)}
"""

_SIGTERM_CHILD = """
preemption.install_preemption_handler()
for step in range(1, 10_000):
  time.sleep(0.05)  # one "train step"
  print(f"step {step}", flush=True)
  if preemption.preempted():
    ckpt.save(step, state=state(step), meta={"step": step}, force=True)
    ckpt.wait()
    print(f"saved {step}", flush=True)
    sys.exit(0)
"""

_SIGKILL_CHILD = """
ckpt.save(1, state=state(1), meta={"step": 1}, force=True)
ckpt.wait()
ckpt.save(2, state=state(2), meta={"step": 2}, force=True)  # async: returns before it is on disk
time.sleep(float(sys.argv[2]))
os.kill(os.getpid(), signal.SIGKILL)
"""


def _child(script: str, *args: str) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(_REPO))
  code = textwrap.dedent(_CHILD_PRELUDE) + textwrap.dedent(script)
  return subprocess.Popen(
    [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=_REPO
  )


def _abstract_child_state() -> dict:
  one = NamedSharding(_mesh((1, 1), jax.devices()[:1]), P())
  shapes = {"w": ((256, 256), jnp.float32), "step": ((), jnp.int32)}
  abstract = {k: jax.ShapeDtypeStruct(s, d, sharding=one) for k, (s, d) in shapes.items()}
  key = jax.eval_shape(lambda: jax.random.key(0))
  return abstract | {"rng": jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=one)}


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_cleanly(tmp_path):
  proc = _child(_SIGTERM_CHILD, str(tmp_path))
  try:
    for line in proc.stdout:
      if line.strip() == "step 3":
        proc.send_signal(signal.SIGTERM)
        break
    out, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 0
  saved = int(out.split("saved ")[1].split()[0])
  assert saved >= 3
  ckpt = checkpoint_lib.Checkpointer(tmp_path, save_every=1000, keep=3)
  assert ckpt.latest_step() == saved
  state, meta = ckpt.restore(abstract_state=_abstract_child_state())
  assert meta == {"step": saved} and int(state["step"]) == saved
  np.testing.assert_array_equal(state["w"], np.full((256, 256), float(saved)))


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", ["0", "0.02", "1.0"])
def test_sigkill_mid_save_leaves_a_complete_checkpoint(tmp_path, delay_s):
  proc = _child(_SIGKILL_CHILD, str(tmp_path), delay_s)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  ckpt = checkpoint_lib.Checkpointer(tmp_path, save_every=1000, keep=3)
  step = ckpt.latest_step()
  assert step in (1, 2)
  state, meta = ckpt.restore(abstract_state=_abstract_child_state())
  assert meta == {"step": step} and int(state["step"]) == step
  np.testing.assert_array_equal(state["w"], np.full((256, 256), float(step)))
  np.testing.assert_array_equal(
    jax.random.key_data(state["rng"]), jax.random.key_data(jax.random.key(step))
  )
  complete = sorted(int(n) for n in os.listdir(tmp_path) if n.isdigit())
  assert complete == ckpt.all_steps() and complete[-1] == step
  if step == 1:
    # The resumed run saves the interrupted step again, over the leftover temporary directory.
    one = NamedSharding(_mesh((1, 1), jax.devices()[:1]), P())
    redo = jax.tree.map(
      lambda a: jax.device_put(a, one), {"w": state["w"] + 1, "step": jnp.int32(2)}
    )
    assert ckpt.save(2, state=redo | {"rng": jax.random.key(2)}, meta={"step": 2}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    assert ckpt.restore(abstract_state=_abstract_child_state())[1] == {"step": 2}
  ckpt.close()


# ------------------------------------------------------------------------------------------------
# Faults: a damaged newest step, a failed background write.


def _two_steps(directory: pathlib.Path) -> tuple[checkpoint_lib.Checkpointer, dict]:
  one = NamedSharding(_mesh((1, 1), jax.devices()[:1]), P())

  def state(v: int) -> dict:
    return {"w": jax.device_put(jnp.full((16, 8), float(v)), one), "rng": jax.random.key(v)}

  with checkpoint_lib.Checkpointer(directory, save_every=1, keep=3) as ckpt:
    for step in (1, 2):
      ckpt.save(step, state=state(step), meta={"step": step})
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
    jax.eval_shape(lambda: state(0)),
  )
  return checkpoint_lib.Checkpointer(directory, save_every=1, keep=3), abstract


def _truncate(path: pathlib.Path) -> None:
  with open(path, "r+b") as f:
    f.truncate(path.stat().st_size // 2)


_FAULTS = {
  "truncated_data": lambda s: [_truncate(p) for p in (s / "state" / "d").iterdir()],
  "deleted_data": lambda s: [p.unlink() for p in (s / "state" / "d").iterdir()],
  "deleted_manifest": lambda s: (s / "state" / "manifest.ocdbt").unlink(),
  "deleted_state_metadata": lambda s: (s / "state" / "_METADATA").unlink(),
  "deleted_meta": lambda s: (s / "meta" / "metadata").unlink(),
  "truncated_meta": lambda s: _truncate(s / "meta" / "metadata"),
  "deleted_format": lambda s: __import__("shutil").rmtree(s / "format"),
  "emptied_step": lambda s: [__import__("shutil").rmtree(p) for p in s.iterdir() if p.is_dir()],
}


@pytest.mark.parametrize("fault", sorted(_FAULTS))
def test_damaged_newest_step_is_moved_aside_and_the_previous_one_restored(tmp_path, fault, caplog):
  ckpt, abstract = _two_steps(tmp_path / "ckpt")
  _FAULTS[fault](tmp_path / "ckpt" / "2")
  with pytest.raises(checkpoint_lib.DamagedCheckpointError, match=r"step 2 .* is unreadable"):
    ckpt.restore(abstract_state=abstract)  # asked for explicitly, a damaged step is an error
  state, meta, damaged = ckpt.restore_newest_readable(abstract_state=abstract)
  assert meta == {"step": 1} and damaged == [2]
  np.testing.assert_array_equal(state["w"], np.full((16, 8), 1.0))
  assert ckpt.all_steps() == [1]
  assert (tmp_path / "ckpt.damaged" / "2").is_dir()  # moved, not deleted
  lines = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
  assert len(lines) == 1 and "\n" not in lines[0] and "ckpt.damaged/2" in lines[0]
  ckpt.close()


def test_no_readable_step_is_one_clear_error(tmp_path):
  ckpt, abstract = _two_steps(tmp_path / "ckpt")
  for step in ("1", "2"):
    (tmp_path / "ckpt" / step / "state" / "manifest.ocdbt").unlink()
  with pytest.raises(checkpoint_lib.CheckpointError, match=r"no readable checkpoint in .*ckpt"):
    ckpt.restore_newest_readable(abstract_state=abstract)
  assert sorted(os.listdir(tmp_path / "ckpt.damaged")) == ["1", "2"]


def test_a_changed_state_layout_is_not_damage(tmp_path):
  ckpt, abstract = _two_steps(tmp_path / "ckpt")
  one = abstract["w"].sharding
  wrong = abstract | {"w": jax.ShapeDtypeStruct((16, 9), jnp.float32, sharding=one)}
  with pytest.raises(checkpoint_lib.CheckpointMismatchError, match=r"w: saved float32\[16, 8\]"):
    ckpt.restore_newest_readable(abstract_state=wrong)
  assert ckpt.all_steps() == [1, 2] and not (tmp_path / "ckpt.damaged").exists()


def test_check_meta_errors_propagate_and_move_nothing(tmp_path):
  ckpt, abstract = _two_steps(tmp_path / "ckpt")

  def refuse(step, meta):
    raise KeyError(f"config of step {step} differs")

  with pytest.raises(KeyError, match="step 2"):
    ckpt.restore_newest_readable(abstract_state=abstract, check_meta=refuse)
  assert ckpt.all_steps() == [1, 2]


class _FailedWrite:
  """An orbax commit future whose write fails after a moment, as a full disk does."""

  def __init__(self, directory):
    self.directory = directory

  def result(self, timeout=None):
    import errno
    import time

    time.sleep(0.1)
    raise OSError(errno.ENOSPC, "No space left on device", str(self.directory))


def test_failed_background_write_is_reported_once_and_keeps_the_previous_step(
  tmp_path, monkeypatch
):
  ckpt, abstract = _two_steps(tmp_path / "ckpt")
  original = checkpoint_lib.ocp.StandardCheckpointHandler.async_save

  async def failing(self, directory, *args, **kwargs):
    futures = await original(self, directory, *args, **kwargs)
    return [*(futures or []), _FailedWrite(directory)]

  monkeypatch.setattr(checkpoint_lib.ocp.StandardCheckpointHandler, "async_save", failing)
  state, _, _ = ckpt.restore_newest_readable(abstract_state=abstract)
  assert ckpt.save(3, state=state, meta={"step": 3})  # returns at once; the write fails later
  with pytest.raises(checkpoint_lib.CheckpointWriteError) as e:
    for _ in range(100):  # check() never blocks: poll until the write has failed
      ckpt.check()
      __import__("time").sleep(0.05)
  message = str(e.value)
  assert "step 3" in message and "No space left on device" in message and "\n" not in message
  assert "steps on disk ([1, 2]) are intact" in message
  ckpt.check()  # once: not raised again by check, wait or close
  ckpt.wait()
  with pytest.raises(checkpoint_lib.CheckpointWriteError, match=r"not saving step 4: .* step 3"):
    ckpt.save(4, state=state, meta={"step": 4})  # no silent saves after a failed one
  ckpt.close()
  monkeypatch.undo()
  reopened = checkpoint_lib.Checkpointer(tmp_path / "ckpt", save_every=1, keep=3)
  assert reopened.restore_newest_readable(abstract_state=abstract)[1:] == ({"step": 2}, [])
  reopened.close()
