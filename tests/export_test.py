"""launch/export.py on a training workdir: transformers computes the trained policy's logits."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from earl_jax import checkpoint, export
from earl_jax.model import logits
from earl_jax.rl import loop
from tests.rl.loop_test import REPO, tiny_config


def _export(*args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "launch/export.py", *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_export_of_a_trained_workdir(tmp_path):
  cfg = tiny_config(num_steps=2, eval_every=0, checkpoint_every=1)
  trainer = loop.Trainer(cfg, tmp_path / "run")
  trainer.run()
  params = jax.device_get(trainer.stages.state.params)  # the last step's policy
  graphdef = trainer.stages.graphdef

  out = tmp_path / "hf"
  done = _export(f"--workdir={tmp_path / 'run'}", f"--out={out}")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "exported step 1 " in done.stdout and "built-in 'char' tokenizer" in done.stdout

  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 13)).astype(np.int32)
  ours = np.asarray(jax.jit(logits)(nnx.merge(graphdef, params), tokens))
  ours = ours[..., : cfg.model.vocab_size]  # the padded rows are not exported
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf(torch.as_tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)

  # An earlier step, by number; a step that is not there is one clear error.
  assert export.export_workdir(str(tmp_path / "run"), str(tmp_path / "hf0"), step=0).step == 0
  with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 7 .*steps: \[0, 1\]"):
    export.export_workdir(str(tmp_path / "run"), str(tmp_path / "hf7"), step=7)


def test_export_of_a_directory_without_checkpoints_is_one_line(tmp_path):
  done = _export(f"--workdir={tmp_path}", f"--out={tmp_path / 'o'}")
  assert done.returncode == 1 and done.stderr.startswith("earl_jax: ")
  assert "has no checkpoints/ directory" in done.stderr and "Traceback" not in done.stderr


def test_restore_arrays_reads_named_arrays_only(tmp_path):
  with checkpoint.Checkpointer(tmp_path, save_every=1, keep=2, async_save=False) as ckpt:
    state = {"a": {"x": jax.numpy.arange(3.0), "y": jax.numpy.zeros(4)}}
    ckpt.save(0, state=state, meta={}, force=True)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = ckpt.restore_arrays(0, {"a.x": jax.ShapeDtypeStruct((3,), np.float32, sharding=dev)})
    assert list(got) == ["a.x"]
    np.testing.assert_array_equal(got["a.x"], [0.0, 1.0, 2.0])
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"a.y: saved float32\[4\]"):
      ckpt.restore_arrays(0, {"a.y": jax.ShapeDtypeStruct((5,), np.float32, sharding=dev)})
    with pytest.raises(checkpoint.CheckpointMismatchError, match="not in the checkpoint"):
      ckpt.restore_arrays(0, {"a.z": jax.ShapeDtypeStruct((3,), np.float32, sharding=dev)})
