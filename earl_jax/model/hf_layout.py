"""Where each Decoder parameter lives in a Hugging Face Llama / Qwen2 checkpoint, both ways.

Data flow: ``hf_import`` reads, for each device, only the block of a checkpoint tensor that the
device's shard of our parameter needs (``Entry.read`` on a safetensors slice); ``hf_export``
turns our parameters back into checkpoint tensors (``Entry.to_hf``). One table serves both, so an
exported checkpoint is read back by the same mapping.

Our layouts: embeddings [Vp, D] (rows padded to ``padded_vocab_size``), lm-head [D, Vp],
q/k/v [D, N, Dh] (+ bias [N, Dh]), o [H, Dh, D], MLP [D, F] / [F, D], and every block parameter
stacked on a leading layer axis [L, ...] (``Decoder.blocks``), one checkpoint tensor per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from earl_jax.model.config import ModelConfig

# Our index of one parameter block (layer axis excluded): (start, stop) per axis.
Spans = tuple[tuple[int, int], ...]
# Reads the block ``spans`` of our layout from a checkpoint tensor (a safetensors slice or an
# array: anything indexable by slices), as a numpy array.
Read = Callable[[Any, Spans], np.ndarray]
ToHF = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One Decoder parameter: its checkpoint tensors (one, or one per layer), their HF shape, how
  to read a block of our layout from one of them, and how to write one back."""

  names: tuple[str, ...]
  hf_shape: tuple[int, ...]
  read: Read
  to_hf: ToHF

  @property
  def stacked(self) -> bool:
    return len(self.names) > 1 or self.names[0].startswith("model.layers.")


def spans_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Spans:
  """(start, stop) per axis of an index that ``jax.make_array_from_callback`` passes."""
  out = []
  for s, n in zip(index, shape, strict=True):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"strided shard index {index} of a parameter of shape {shape}")
    out.append((start, stop))
  return tuple(out)


def _plain(t: Any, spans: Spans) -> np.ndarray:
  return np.asarray(t[tuple(slice(a, b) for a, b in spans)])


def _padded_rows(vocab: int) -> Read:
  """[Vp, D] from [V, D]: rows past the checkpoint's vocabulary are zeros."""

  def read(t: Any, spans: Spans) -> np.ndarray:
    (r0, r1), (c0, c1) = spans
    if r0 >= vocab:  # padding only (safetensors refuses an empty slice; one row gives the dtype)
      return np.zeros((r1 - r0, c1 - c0), _plain(t, ((vocab - 1, vocab), (c0, c1))).dtype)
    real = _plain(t, ((r0, min(r1, vocab)), (c0, c1)))
    return np.pad(real, ((0, r1 - r0 - real.shape[0]), (0, 0)))

  return read


def _transposed(read: Read) -> Read:
  """Our [A, B] block is the transpose of the checkpoint's [B, A] block."""
  return lambda t, spans: read(t, spans[::-1]).T


def _heads_in(head_dim: int) -> Read:
  """q/k/v [D, N, Dh] from [N*Dh, D]: rows n*Dh..(n+1)*Dh are head n."""

  def read(t: Any, spans: Spans) -> np.ndarray:
    (d0, d1), (n0, n1), (h0, h1) = spans
    rows = _plain(t, ((n0 * head_dim, n1 * head_dim), (d0, d1)))
    return rows.T.reshape(d1 - d0, n1 - n0, head_dim)[:, :, h0:h1]

  return read


def _heads_bias(head_dim: int) -> Read:
  def read(t: Any, spans: Spans) -> np.ndarray:
    (n0, n1), (h0, h1) = spans
    return _plain(t, ((n0 * head_dim, n1 * head_dim),)).reshape(n1 - n0, head_dim)[:, h0:h1]

  return read


def _heads_out(head_dim: int) -> Read:
  """o [H, Dh, D] from [D, H*Dh]."""

  def read(t: Any, spans: Spans) -> np.ndarray:
    (n0, n1), (h0, h1), (d0, d1) = spans
    cols = _plain(t, ((d0, d1), (n0 * head_dim, n1 * head_dim)))
    return cols.T.reshape(n1 - n0, head_dim, d1 - d0)[:, h0:h1, :]

  return read


def tensor_map(cfg: ModelConfig) -> dict[tuple[Any, ...], Entry]:
  """Our state path -> its checkpoint tensors, for ``cfg``'s architecture."""
  d, f, h, k, dh = cfg.embed_dim, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  v = cfg.vocab_size
  rows = _padded_rows(v)
  out: dict[tuple[Any, ...], Entry] = {
    ("embed",): Entry(("model.embed_tokens.weight",), (v, d), rows, lambda w: w[:v]),
    ("final_norm", "scale"): Entry(("model.norm.weight",), (d,), _plain, lambda w: w),
  }
  if not cfg.tie_embeddings:
    out[("lm_head",)] = Entry(("lm_head.weight",), (v, d), _transposed(rows), lambda w: w.T[:v])

  def layers(suffix: str) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers))

  for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
    out[("blocks", ours, "scale")] = Entry(layers(theirs + ".weight"), (d,), _plain, lambda w: w)
  for name, n in (("q", h), ("k", k), ("v", k)):
    proj = f"self_attn.{name}_proj"
    out[("blocks", "attn", name)] = Entry(
      layers(proj + ".weight"), (n * dh, d), _heads_in(dh), lambda w: w.reshape(d, -1).T
    )
    if cfg.qkv_bias:
      out[("blocks", "attn", name + "_bias")] = Entry(
        layers(proj + ".bias"), (n * dh,), _heads_bias(dh), lambda w: w.reshape(-1)
      )
  out[("blocks", "attn", "o")] = Entry(
    layers("self_attn.o_proj.weight"), (d, h * dh), _heads_out(dh), lambda w: w.reshape(-1, d).T
  )
  for name, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
    out[("blocks", "mlp", name)] = Entry(
      layers(f"mlp.{name}_proj.weight"), shape, _transposed(_plain), lambda w: w.T
    )
  return out
