"""Sharded loading of HF checkpoints: each device gets its block, read alone from safetensors."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from earl_jax.model import Decoder, from_pretrained, hf_import, hf_layout, logits
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.types import Stage
from tests.model.hf_import_test import _hf_logits, _save_hf, _tokens
from tests.multiprocess import run_workers

_WORKER = Path(__file__).with_name("hf_sharded_load_worker.py")


class _CountingSlices:
  """Wraps a safetensors slice: records the element count of every block read from it."""

  def __init__(self, inner, name: str, reads: list):
    self._inner, self._name, self._reads = inner, name, reads

  def get_shape(self):
    return self._inner.get_shape()

  def __getitem__(self, index):
    block = self._inner[index]
    self._reads.append((self._name, block.size))
    return block


def _load_sharded(path, monkeypatch, plan):
  """(cfg, model, reads): the checkpoint loaded onto ``plan``, with every slice read recorded."""
  reads: list[tuple[str, int]] = []
  getitem = hf_import._Tensors.__getitem__
  monkeypatch.setattr(
    hf_import._Tensors,
    "__getitem__",
    lambda self, name: _CountingSlices(getitem(self, name), name, reads),
  )
  cfg, _ = hf_import.read_config(str(path))
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  shardings = mesh_lib.state_shardings(nnx.state(abstract), plan)
  # A whole tensor on one device, re-laid out afterwards, would be a device-to-device copy.
  with jax.transfer_guard_device_to_device("disallow_explicit"):
    model = hf_import.load_weights(str(path), cfg, shardings)
  return cfg, model, shardings, reads


@pytest.mark.parametrize(
  "arch, overrides", [("qwen2", {}), ("llama", {"tie_word_embeddings": True, "head_dim": 12})]
)
def test_sharded_load_reads_blocks_only_equals_host_load(tmp_path, monkeypatch, arch, overrides):
  _save_hf(tmp_path, arch, max_shard_size="20KB", **overrides)  # a multi-file checkpoint
  _, host = from_pretrained(str(tmp_path))  # everything on one device
  plan = make_stage_plan(Stage.UPDATE, range(8), 1, 4, 2)  # fsdp=4, tensor=2
  cfg, model, shardings, reads = _load_sharded(tmp_path, monkeypatch, plan)

  flat_sh = dict(nnx.to_flat_state(shardings))
  host_flat = dict(nnx.to_flat_state(nnx.state(host)))
  largest_block = {}
  for path, var in nnx.to_flat_state(nnx.state(model)):
    arr, want = var.get_value(), flat_sh[path].get_value()
    assert arr.sharding == want, path
    per_device = math.prod(want.shard_shape(arr.shape)) * arr.dtype.itemsize
    assert {s.data.nbytes for s in arr.addressable_shards} == {per_device}, path
    expected = np.asarray(host_flat[path].get_value())
    for shard in arr.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index], err_msg=path)
    block = want.shard_shape(arr.shape)
    per_layer = block[1:] if path[0] == "blocks" else block
    entry = hf_layout.tensor_map(cfg)[path]
    for name in entry.names:
      largest_block[name] = math.prod(per_layer)
  # Every read is one device block of one checkpoint tensor (or one row, for a padding block's
  # dtype), never a whole tensor that some device holds only a part of.
  assert reads
  for name, size in reads:
    assert size <= largest_block[name], (name, size, largest_block[name])
  sharded_tensor = "model.layers.0.mlp.gate_proj.weight"  # [F, D]: split by both fsdp and tensor
  assert max(s for n, s in reads if n == sharded_tensor) * 8 == cfg.mlp_dim * cfg.embed_dim

  tokens = _tokens()
  ours = np.asarray(jax.jit(logits)(model, tokens))
  np.testing.assert_allclose(ours, np.asarray(jax.jit(logits)(host, tokens)), atol=1e-5, rtol=0)
  np.testing.assert_allclose(ours, _hf_logits(tmp_path, tokens), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_two_processes_load_their_blocks(tmp_path):
  _save_hf(tmp_path, "qwen2", max_shard_size="20KB")
  results = run_workers(_WORKER, str(tmp_path))
  for i, (returncode, out) in enumerate(results):
    assert returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    assert f"ok {i} params" in out and f"ok {i} logits" in out, out[-4000:]
