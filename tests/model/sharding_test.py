"""The decoder under jit on a (data=2, fsdp=2, tensor=2) mesh gives the unsharded logits.

The logical->mesh rule table lives here on purpose: the model only names logical axes, and this
test plays the part of the parallel layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax.model import Decoder, cache_partition_specs, init_cache, logits, prefill
from earl_jax.model.config import ModelConfig
from earl_jax.types import BATCH, EMBED, HEADS, KV_HEADS, MLP, VOCAB

_CFG = ModelConfig(
  vocab_size=100,
  embed_dim=32,
  mlp_dim=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  qkv_bias=True,
  vocab_multiple=64,
)
_RULES = {EMBED: "fsdp", HEADS: "tensor", KV_HEADS: "tensor", MLP: "tensor", VOCAB: "tensor"}
_RULES[BATCH] = ("data", "fsdp")


def _mesh_spec(logical: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """Maps logical names to mesh axes; a dimension that does not divide its axes raises."""
  out = []
  for name, dim in zip(logical, shape):
    axes = _RULES.get(name)
    size = int(np.prod([mesh.shape[a] for a in np.atleast_1d(axes)])) if axes else 1
    if dim % size:
      raise ValueError(f"dimension {name}={dim} does not divide mesh axes {axes} (size {size})")
    out.append(axes)
  return P(*out)


def _shardings(specs, values, mesh: Mesh):
  return jax.tree.map(
    lambda spec, v: NamedSharding(mesh, _mesh_spec(spec, v.shape, mesh)),
    specs,
    values,
    is_leaf=lambda x: isinstance(x, P),
  )


@pytest.fixture(scope="module")
def mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


@pytest.fixture(scope="module")
def model() -> Decoder:
  model = Decoder(_CFG, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  for _, var in nnx.to_flat_state(nnx.state(model)):
    var.set_value(jnp.asarray(rng.normal(0.0, 0.4, var.get_value().shape), jnp.float32))
  return model


@pytest.mark.requires_devices(8)
def test_sharded_logits_match_unsharded(mesh, model):
  graphdef, state = nnx.split(model)
  state_shardings = _shardings(nnx.get_partition_spec(state), state, mesh)
  sharded_state = jax.device_put(state, state_shardings)
  q = sharded_state["blocks"]["attn"]["q"].get_value()
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)  # the layer axis is never sharded
  assert q.addressable_shards[0].data.shape == (2, 16, 2, 8)  # really split, not replicated
  embed = sharded_state["embed"].get_value()
  assert embed.addressable_shards[0].data.shape == (64, 16)
  assert all(
    not v.get_value().sharding.is_fully_replicated
    for path, v in nnx.to_flat_state(sharded_state)
    if "scale" not in path  # norms are the only unsharded parameters
  )
  tokens = np.random.default_rng(1).integers(0, _CFG.vocab_size, (4, 12)).astype(np.int32)
  tokens_sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
  out_sharding = NamedSharding(mesh, P(("data", "fsdp"), None, None))
  fn = jax.jit(
    lambda s, t: logits(nnx.merge(graphdef, s), t),
    in_shardings=(state_shardings, tokens_sharding),
    out_shardings=out_sharding,
  )
  out = fn(sharded_state, jax.device_put(tokens, tokens_sharding))
  assert out.sharding == out_sharding
  np.testing.assert_allclose(out, jax.jit(logits)(model, tokens), atol=1e-5, rtol=0)


@pytest.mark.requires_devices(8)
def test_sharded_cache_prefill_matches_unsharded(mesh, model):
  graphdef, state = nnx.split(model)
  state_shardings = _shardings(nnx.get_partition_spec(state), state, mesh)
  cache = init_cache(_CFG, 4, 16)
  cache_shardings = _shardings(cache_partition_specs(), cache, mesh)
  # [L, B, K, S, Dh]: batch on data x fsdp, kv heads on tensor
  assert cache_shardings.k.spec == P(None, ("data", "fsdp"), "tensor", None, None)
  tokens = np.random.default_rng(2).integers(0, _CFG.vocab_size, (4, 6)).astype(np.int32)
  mask = np.array([[0, 0, 1, 1, 1, 1], [1] * 6, [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1]], bool)
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  args = (tokens, pos, mask)

  def run(s, c, *a):
    return prefill(nnx.merge(graphdef, s), c, *a)

  fn = jax.jit(run, in_shardings=(state_shardings, cache_shardings, None, None, None))
  out, new_cache = fn(
    jax.device_put(state, state_shardings), jax.device_put(cache, cache_shardings), *args
  )
  ref_out, ref_cache = jax.jit(run)(state, cache, *args)
  np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(new_cache.k, ref_cache.k, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(new_cache.valid_BxS, ref_cache.valid_BxS)
