"""The decoder on its own: causality, parameter axes, remat, dtypes, RoPE against HF."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from jax import ad_checkpoint
from jax.sharding import PartitionSpec as P
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from earl_jax.model import PAD_LOGIT, Decoder, attention, layers, logits
from earl_jax.model.config import ModelConfig, RopeConfig, RopeType
from earl_jax.model.layers import rope_inv_freq
from earl_jax.types import DType

_CFG = ModelConfig(
  vocab_size=53,
  embed_dim=24,
  mlp_dim=40,
  num_layers=2,
  num_heads=6,
  num_kv_heads=3,
  head_dim=6,
  qkv_bias=True,
  vocab_multiple=16,
)


def _randomized(cfg: ModelConfig, seed: int = 0) -> Decoder:
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for _, var in nnx.to_flat_state(nnx.state(model)):
    value = var.get_value()
    var.set_value(jnp.asarray(rng.normal(0.0, 0.4, value.shape), value.dtype))
  return model


def _tokens(b: int = 2, t: int = 9, seed: int = 3) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, _CFG.vocab_size, (b, t)).astype(np.int32)


def test_causal_future_token_changes_only_later_logits():
  model = _randomized(_CFG)
  tokens = _tokens()
  changed = tokens.copy()
  changed[:, 5] = (changed[:, 5] + 1) % _CFG.vocab_size
  full = jax.jit(logits)
  before, after = np.asarray(full(model, tokens)), np.asarray(full(model, changed))
  np.testing.assert_allclose(before[:, :5], after[:, :5], atol=1e-6, rtol=0)
  assert np.all(np.abs(before[:, 5:] - after[:, 5:]).max(axis=-1) > 1e-3)


def test_logits_shapes_and_padded_vocab():
  model = _randomized(_CFG)
  tokens = _tokens()
  assert logits(model, tokens).shape == (2, 9, 53)
  out, _ = model(tokens, np.zeros((2, 9), np.int32), mask_BxT=np.ones((2, 9), bool))
  assert out.shape == (2, 9, 64) and out.dtype == jnp.float32
  np.testing.assert_array_equal(out[..., 53:], PAD_LOGIT)
  assert np.all(jnp.argmax(out, axis=-1) < 53)
  assert np.all(jax.nn.softmax(out, axis=-1)[..., 53:] == 0.0)


@pytest.mark.parametrize(("tie", "bias"), [(False, True), (True, False)])
def test_parameter_logical_axes_and_count(tie, bias):
  cfg = dataclasses.replace(_CFG, tie_embeddings=tie, qkv_bias=bias)
  state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  specs = {path: spec for path, spec in nnx.to_flat_state(nnx.get_partition_spec(state))}
  block = ("blocks",)  # stacked: every block parameter has a leading layers axis
  expected = {
    ("embed",): P("vocab", "embed"),
    ("final_norm", "scale"): P("norm"),
    (*block, "attn_norm", "scale"): P("layers", "norm"),
    (*block, "attn", "q"): P("layers", "embed", "heads", "head_dim"),
    (*block, "attn", "k"): P("layers", "embed", "kv_heads", "head_dim"),
    (*block, "attn", "o"): P("layers", "heads", "head_dim", "embed"),
    (*block, "mlp", "gate"): P("layers", "embed", "mlp"),
    (*block, "mlp", "down"): P("layers", "mlp", "embed"),
  }
  if not tie:
    expected[("lm_head",)] = P("embed", "vocab")
  if bias:
    expected[(*block, "attn", "v_bias")] = P("layers", "kv_heads", "head_dim")
  for path, spec in expected.items():
    assert specs[path].get_value() == spec, path
  assert (("lm_head",) in specs) == (not tie)
  assert ((*block, "attn", "q_bias") in specs) == bias
  assert all(len(s.get_value()) >= 1 for s in specs.values())  # every parameter is named
  count = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(state))
  assert count == cfg.num_params


def test_remat_policies_same_values_and_gradients():
  model = _randomized(_CFG)
  tokens = _tokens()
  pos = np.broadcast_to(np.arange(9, dtype=np.int32), (2, 9))
  mask = np.ones((2, 9), bool)
  graphdef, state = nnx.split(model)

  def loss(state: nnx.State, remat: str) -> jax.Array:
    h, _ = nnx.merge(graphdef, state).hidden(tokens, pos, mask_BxT=mask, remat=remat)
    return jnp.sum(jnp.square(h))

  grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  ref_value, ref_grad = grad_fn(state, "none")
  for remat in ("full", "dots"):
    value, grad = grad_fn(state, remat)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), grad, ref_grad
    )
  with pytest.raises(ValueError, match="remat='some'"):
    model.hidden(tokens, pos, mask_BxT=mask, remat="some")


def test_input_shape_errors():
  model = _randomized(_CFG)
  with pytest.raises(ValueError, match=r"positions_BxT has shape \(2, 8\)"):
    model.hidden(_tokens(), np.zeros((2, 8), np.int32), mask_BxT=np.ones((2, 9), bool))


def test_bf16_compute_close_to_f32():
  model = _randomized(_CFG)
  bf16_cfg = dataclasses.replace(_CFG, compute_dtype=DType.BFLOAT16)
  graphdef_bf16, _ = nnx.split(nnx.eval_shape(lambda: Decoder(bf16_cfg, rngs=nnx.Rngs(0))))
  model_bf16 = nnx.merge(graphdef_bf16, nnx.state(model))
  h, _ = model_bf16.hidden(_tokens(), np.zeros((2, 9), np.int32), mask_BxT=np.ones((2, 9), bool))
  assert h.dtype == jnp.bfloat16
  ours, ref = np.asarray(logits(model_bf16, _tokens())), np.asarray(logits(model, _tokens()))
  assert ours.dtype == np.float32
  err = np.abs(ours - ref).max()
  assert 0 < err < 0.1 * np.abs(ref).max()


@pytest.mark.parametrize("head_dim", [8, 64])
def test_llama3_inv_freq_matches_transformers(head_dim):
  rope = RopeConfig(
    theta=500000.0,
    type=RopeType.LLAMA3,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
  )
  hf_cfg = transformers.LlamaConfig(
    hidden_size=head_dim * 2,
    num_attention_heads=2,
    max_position_embeddings=131072,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    | {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
  )
  hf_inv_freq, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
  assert scaling == 1.0
  ours = rope_inv_freq(rope, head_dim)
  np.testing.assert_allclose(ours, hf_inv_freq.numpy(), rtol=1e-6, atol=0)
  plain = rope_inv_freq(RopeConfig(theta=500000.0), head_dim)
  assert np.abs(ours - plain).max() > 1e-4  # the scaling is really applied


def test_scanned_and_unrolled_layers_agree():
  """The scan over stacked blocks and the unrolled layers compute the same logits/grads."""
  cfg = dataclasses.replace(_CFG, num_layers=3, forward_layers="scan")
  model = _randomized(cfg)
  unrolled = nnx.merge(
    nnx.graphdef(Decoder(dataclasses.replace(cfg, forward_layers="unrolled"), rngs=nnx.Rngs(0))),
    nnx.state(model),
  )
  tokens = _tokens()

  def loss(m):
    return jnp.sum(logits(m, tokens)[..., :5] ** 2)

  np.testing.assert_allclose(
    np.asarray(jax.jit(logits)(model, tokens)),
    np.asarray(jax.jit(logits)(unrolled, tokens)),
    atol=1e-5,
  )
  g_scan = nnx.state(jax.jit(nnx.grad(loss))(model))
  g_unrolled = nnx.state(jax.jit(nnx.grad(loss))(unrolled))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5), g_scan, g_unrolled
  )


def test_forward_layers_auto_unrolls_on_cpu_only():
  """``forward_layers="auto"``: unrolled on CPU (no while loop over the blocks in the program),
  scanned on accelerators; an unknown value names the key and what is allowed."""
  tokens = _tokens()

  def whiles(how: str) -> int:
    model = Decoder(dataclasses.replace(_CFG, forward_layers=how), rngs=nnx.Rngs(0))
    return jax.jit(logits).lower(model, tokens).as_text().count("stablehlo.while")

  assert jax.default_backend() == "cpu"
  assert whiles("scan") == 1
  assert whiles("auto") == whiles("unrolled") == 0
  auto = dataclasses.replace(_CFG, forward_layers="auto")
  assert auto.unrolled_forward("cpu")
  assert not auto.unrolled_forward("gpu") and not auto.unrolled_forward("tpu")
  assert not dataclasses.replace(_CFG, forward_layers="scan").unrolled_forward("cpu")
  with pytest.raises(ValueError, match=r"forward_layers.*auto \| scan \| unrolled"):
    dataclasses.replace(_CFG, forward_layers="loop")


def _mlp_sized_residuals(monkeypatch, activation, cfg: ModelConfig, b: int, t: int) -> int:
  """How many [B, T, F]-sized arrays one SwiGLU keeps for its backward pass, with ``activation``
  as its silu(gate) * up."""
  monkeypatch.setattr(layers, "swiglu", activation)
  mlp = layers.SwiGLU(cfg, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(b, t, cfg.embed_dim)), jnp.float32)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    ad_checkpoint.print_saved_residuals(lambda x: jnp.sum(mlp(x) ** 2), x)
  shapes = re.findall(r"\w+\[([\d,]+)\]", out.getvalue())
  return sum(math.prod(int(n) for n in s.split(",")) == b * t * cfg.mlp_dim for s in shapes)


def test_rms_norm_backward_keeps_its_input_only():
  """rms_norm gives the plain expression's values and gradients (input, scale), and its backward
  pass keeps x alone of the [B, T, D] arrays it makes: with the projection that reads it, two
  such arrays in all (x, and the output for the weight gradient) where autodiff kept four."""
  b, t, d = 2, 7, 24
  rng = np.random.default_rng(0)
  x, scale = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((b, t, d), (d,)))
  w = jnp.asarray(rng.normal(size=(d, 5)), jnp.float32)

  def plain(x, scale, eps):
    x32 = x.astype(jnp.float32)
    ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(ms + eps)).astype(x.dtype) * scale.astype(x.dtype)[None, None]

  def loss(norm):
    return lambda x, scale, w: jnp.sum(jnp.tanh(layers.dense(norm(x, scale, 1e-6), w)))

  np.testing.assert_allclose(layers.rms_norm(x, scale, 1e-6), plain(x, scale, 1e-6), rtol=1e-6)
  ours, reference = (jax.grad(loss(f), (0, 1, 2))(x, scale, w) for f in (layers.rms_norm, plain))
  for a, b_ in zip(ours, reference, strict=True):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6)

  def kept(norm) -> int:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      ad_checkpoint.print_saved_residuals(loss(norm), x, scale, w)
    shapes = re.findall(r"\w+\[([\d,]+)\]", out.getvalue())
    return sum(math.prod(int(n) for n in s.split(",")) == b * t * d for s in shapes)

  assert kept(layers.rms_norm) == 2
  assert kept(plain) == 4


def test_attention_softmax_backward_holds_less_memory(monkeypatch):
  """The default run's decoder (naive attention on CPU), 16 rows of 128 tokens: the backward
  pass over ``attention.softmax`` compiles to less temp memory than over jax.nn.softmax, by at
  least one layer's [B, H, T, T] probabilities (measured 28 against 41 MB; the 31M update of
  32 x 288 tokens: 3.8 against 4.5 GiB)."""
  b, t = 16, 128
  cfg = ModelConfig(
    vocab_size=105, embed_dim=64, mlp_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, vocab_multiple=8, attention="naive",
  )  # fmt: skip
  graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
  mask = jax.ShapeDtypeStruct((b, t), jnp.bool_)

  def temp() -> int:
    def loss(p, tokens, positions, mask):  # a new function: jit traces it afresh
      h_BxTxD, _ = nnx.merge(graphdef, p).hidden(tokens, positions, mask_BxT=mask)
      return jnp.sum(jnp.sin(h_BxTxD))

    lowered = jax.jit(jax.grad(loss)).lower(params, tokens, tokens, mask)
    return lowered.compile().memory_analysis().temp_size_in_bytes

  ours = temp()
  monkeypatch.setattr(attention, "softmax", lambda x: jax.nn.softmax(x, axis=-1))
  plain = temp()
  assert ours <= plain - b * cfg.num_heads * t * t * 4, (ours, plain)


def test_swiglu_backward_reads_gate_and_up_only(monkeypatch):
  """swiglu gives silu(gate) * up and its gradients, and the MLP's backward pass keeps gate and
  up alone (two [B, T, F] arrays), not the sigmoid and products autodiff would keep too."""
  rng = np.random.default_rng(1)
  gate, up = (jnp.asarray(rng.normal(size=(2, 7, 40)), jnp.float32) for _ in range(2))

  def plain(g, u):
    return jax.nn.silu(g) * u

  for f in (jax.jit(layers.swiglu), jax.jit(plain)):
    np.testing.assert_allclose(f(gate, up), plain(gate, up), rtol=1e-6, atol=1e-6)

  def cubed(f):
    return lambda g, u: jnp.sum(f(g, u) ** 3)

  ours_and_plain = [jax.grad(cubed(f), (0, 1))(gate, up) for f in (layers.swiglu, plain)]
  for ours, reference in zip(*ours_and_plain, strict=True):
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)
  assert _mlp_sized_residuals(monkeypatch, layers.swiglu, _CFG, 2, 7) == 2
  assert _mlp_sized_residuals(monkeypatch, plain, _CFG, 2, 7) > 2  # what it replaces kept (5)
