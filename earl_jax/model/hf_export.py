"""Export of a Decoder as a Hugging Face checkpoint (config.json + safetensors) that transformers
loads as ``Qwen2ForCausalLM`` (q/k/v biases) or ``LlamaForCausalLM``.

Data flow: ``save_pretrained(model, out_dir)`` for a Decoder in memory; ``earl_jax.export`` reads
a training workdir's newest checkpoint one parameter at a time and feeds the same writer
(``launch/export.py``). Tensors go through ``hf_layout``'s table, the one the importer reads, so
an exported checkpoint imports back to the same parameters.

Host memory: one parameter (gathered from its devices; every process takes part, process 0
writes) plus one output file's tensors (``max_shard_bytes``, files named and indexed as
transformers names them).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from earl_jax.model import hf_layout
from earl_jax.model.config import ModelConfig, RopeType
from earl_jax.model.transformer import Decoder

# Files a tokenizer directory may hold that transformers' AutoTokenizer reads.
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "vocab.json",
  "merges.txt",
  "added_tokens.json",
  "chat_template.jinja",
  "generation_config.json",
)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def hf_config(cfg: ModelConfig, dtype: str, base: Mapping[str, Any] | None = None) -> dict:
  """config.json for ``cfg``'s architecture. ``base`` (the config.json the run started from)
  keeps what we do not model (token ids, generation settings); the architecture keys are ours."""
  arch = "qwen2" if cfg.qkv_bias else "llama"
  out = {k: v for k, v in (base or {}).items() if k not in ("rope_scaling", "rope_parameters")}
  rope: dict[str, Any] = {"rope_type": cfg.rope.type.value, "rope_theta": cfg.rope.theta}
  if cfg.rope.type == RopeType.LLAMA3:
    rope.update(
      factor=cfg.rope.factor,
      low_freq_factor=cfg.rope.low_freq_factor,
      high_freq_factor=cfg.rope.high_freq_factor,
      original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
    )
  out.update(
    architectures=["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
    model_type=arch,
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.embed_dim,
    intermediate_size=cfg.mlp_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    hidden_act="silu",
    rms_norm_eps=cfg.rms_norm_eps,
    tie_word_embeddings=cfg.tie_embeddings,
    max_position_embeddings=max(cfg.max_seq_len, int(out.get("max_position_embeddings", 0))),
    rope_theta=cfg.rope.theta,
    rope_parameters=rope,
    torch_dtype=dtype,
  )
  if cfg.rope.type == RopeType.LLAMA3:
    out["rope_scaling"] = rope  # the transformers 4.x spelling
  if arch == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out.update(use_sliding_window=False)
  return out


def hf_tensors(
  cfg: ModelConfig, params: Iterable[tuple[tuple[Any, ...], Any]], dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
  """(checkpoint name, tensor) for (our state path, parameter) pairs: a stacked block parameter
  gives one tensor per layer. Parameters may be sharded jax.Arrays (gathered here, one at a time;
  every process must call this in the same order) or host arrays."""
  mapping = hf_layout.tensor_map(cfg)
  np_dtype = DTYPES[dtype]
  for path, value in params:
    entry = mapping[path]
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
      value = multihost_utils.process_allgather(value, tiled=True)
    host = np.asarray(jax.device_get(value))
    layers = host if entry.stacked else host[None]
    for name, layer in zip(entry.names, layers, strict=True):
      tensor = np.ascontiguousarray(entry.to_hf(layer))
      if tensor.shape != entry.hf_shape:  # a bug in the table, not in the model
        raise AssertionError(f"{path} exports {name} as {tensor.shape}, not {entry.hf_shape}")
      yield name, tensor.astype(np_dtype)


def write_safetensors(
  tensors: Iterable[tuple[str, np.ndarray]], out_dir: str, max_shard_bytes: int = 2 * 2**30
) -> list[str]:
  """Writes the tensors as transformers does: ``model.safetensors``, or numbered shard files and
  ``model.safetensors.index.json`` past ``max_shard_bytes``. Holds one file's tensors at a time.
  Only process 0 writes (every process must still iterate ``tensors``: they gather)."""
  os.makedirs(out_dir, exist_ok=True)
  write = jax.process_index() == 0
  shards: list[dict[str, np.ndarray]] = []
  current: dict[str, np.ndarray] = {}
  size = total = 0
  spill = os.path.join(out_dir, ".export-part-{}.safetensors")
  for name, tensor in tensors:
    if current and size + tensor.nbytes > max_shard_bytes:
      if write:
        save_file(current, spill.format(len(shards)), metadata={"format": "pt"})
      shards.append(dict.fromkeys(current))  # names only; the data is on disk
      current, size = {}, 0
    current[name] = tensor
    size += tensor.nbytes
    total += tensor.nbytes
  if not write:
    return []
  if not shards:
    save_file(current, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return ["model.safetensors"]
  save_file(current, spill.format(len(shards)), metadata={"format": "pt"})
  shards.append(dict.fromkeys(current))
  files, weight_map = [], {}
  for i, names in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    os.replace(spill.format(i), os.path.join(out_dir, file))
    files.append(file)
    weight_map.update(dict.fromkeys(names, file))
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fp:
    json.dump(index, fp, indent=2)
  return files


def copy_tokenizer(src_dir: str, out_dir: str) -> list[str]:
  """Copies the tokenizer files ``src_dir`` has into ``out_dir``; returns their names."""
  copied = []
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(src_dir, name)) and jax.process_index() == 0:
      shutil.copyfile(os.path.join(src_dir, name), os.path.join(out_dir, name))
      copied.append(name)
  return copied


def write_config(cfg: ModelConfig, out_dir: str, dtype: str, base: Mapping | None = None) -> None:
  if jax.process_index() == 0:
    with open(os.path.join(out_dir, "config.json"), "w") as fp:
      json.dump(hf_config(cfg, dtype, base), fp, indent=2, sort_keys=True)


def save_pretrained(
  model: Decoder,
  out_dir: str,
  *,
  dtype: str = "float32",
  tokenizer_dir: str | None = None,
  base_config: Mapping[str, Any] | None = None,
  max_shard_bytes: int = 2 * 2**30,
) -> list[str]:
  """Writes ``model`` to ``out_dir`` as a HF checkpoint; returns the files written.

  ``dtype``: the tensors' dtype on disk ('float32', 'bfloat16' or 'float16'; master weights are
  float32, so bf16 rounds them). ``tokenizer_dir``: a directory whose tokenizer files are copied
  alongside. ``base_config``: the config.json the model came from (token ids etc. are kept).
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}; allowed: {sorted(DTYPES)}")
  cfg = model.cfg
  params = ((path, var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  files = write_safetensors(hf_tensors(cfg, params, dtype), out_dir, max_shard_bytes)
  write_config(cfg, out_dir, dtype, base_config)
  if tokenizer_dir:
    files += copy_tokenizer(tokenizer_dir, out_dir)
  return ["config.json", *files] if jax.process_index() == 0 else []
