"""Import of Hugging Face Llama / Qwen2 checkpoints (config.json + safetensors) into a Decoder.

Data flow: the stage resources (``rl.stages``) call ``read_config`` before any device work and
``load_weights(dir, cfg, shardings)`` once at start-up, straight into the update layout;
``from_pretrained`` is the one-call form for notebooks and benchmarks; ``model_config_from_hf`` is
reused by anything that only needs the architecture (memory models, the plan selector).

The module is created abstractly (``nnx.eval_shape``: no random init of billions of parameters)
and each parameter is filled straight from its checkpoint tensors (``hf_layout``: our layouts and
their blocks). Given the parameters' shardings, every process reads for each of its devices only
that device's block (safetensors slices) and hands it to ``jax.make_array_from_callback``: a 72B
checkpoint never lands whole on one device or one host.

Anything we do not implement (other architectures, sliding windows, unknown RoPE types, o/MLP
biases) raises instead of loading into a model that would silently compute something else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Sharding, SingleDeviceSharding
from safetensors import safe_open

from earl_jax.model import hf_layout
from earl_jax.model.config import ModelConfig, RopeConfig, RopeType
from earl_jax.model.hf_layout import Entry
from earl_jax.model.transformer import Decoder
from earl_jax.types import ConfigError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
  """A checkpoint cannot be imported: the message names the file, key or tensor at fault."""


# ----------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def _architecture(hf: Mapping[str, Any]) -> str:
  archs = hf.get("architectures") or []
  if archs:
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
      raise CheckpointError(
        f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
      )
    return SUPPORTED_ARCHITECTURES[archs[0]]
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_ARCHITECTURES.values():
    raise CheckpointError(
      f"config has no 'architectures' and model_type={model_type!r}; supported: "
      f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type 'llama' or 'qwen2')"
    )
  return model_type


def _require_key(hf: Mapping[str, Any], key: str) -> Any:
  if hf.get(key) is None:
    raise CheckpointError(f"config.json lacks required key '{key}'")
  return hf[key]


def _rope_config(hf: Mapping[str, Any]) -> RopeConfig:
  """Reads ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
  params = hf.get("rope_parameters")
  if params is None:
    params = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}
  if "rope_theta" not in params:
    raise CheckpointError(
      f"rope_parameters {params} lack 'rope_theta' (per-layer RoPE unsupported)"
    )
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == RopeType.DEFAULT.value:
    return RopeConfig(theta=float(params["rope_theta"]))
  if rope_type != RopeType.LLAMA3.value:
    raise CheckpointError(
      f"unsupported rope_type {rope_type!r}; supported: {[t.value for t in RopeType]}"
    )
  missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
  if missing:
    raise CheckpointError(f"llama3 rope parameters {params} lack {missing}")
  return RopeConfig(
    theta=float(params["rope_theta"]),
    type=RopeType.LLAMA3,
    factor=float(params["factor"]),
    low_freq_factor=float(params["low_freq_factor"]),
    high_freq_factor=float(params["high_freq_factor"]),
    original_max_position_embeddings=int(
      params.get("original_max_position_embeddings") or _require_key(hf, "max_position_embeddings")
    ),
  )


def _check_features(hf: Mapping[str, Any], arch: str) -> None:
  """Rejects config features the decoder does not implement, naming the key."""
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"unsupported hidden_act={hf['hidden_act']!r}; supported: 'silu'")
  if arch == "qwen2":
    if hf.get("use_sliding_window"):
      raise CheckpointError("unsupported Qwen2 feature use_sliding_window=true (sliding window)")
    other = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if other:
      raise CheckpointError(f"unsupported layer_types {other}; supported: 'full_attention'")
  if arch == "llama":
    for key in ("attention_bias", "mlp_bias"):
      if hf.get(key):
        raise CheckpointError(f"unsupported Llama feature {key}=true (o_proj / MLP biases)")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise CheckpointError(f"unsupported partial_rotary_factor={hf['partial_rotary_factor']}")


# Keys a checkpoint's config.json decides; every other ModelConfig key is a run-time setting
# (dtypes, attention kernel, scan, context length, vocab padding) taken from the experiment.
ARCHITECTURE_KEYS = (
  "vocab_size",
  "embed_dim",
  "mlp_dim",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "rms_norm_eps",
  "rope",
  "qkv_bias",
  "tie_embeddings",
)


def model_config_from_hf(hf: Mapping[str, Any], settings: ModelConfig | None = None) -> ModelConfig:
  """ModelConfig of a HF ``config.json`` dict (LlamaForCausalLM / Qwen2ForCausalLM).

  The architecture comes from ``hf``; the run-time keys (``param_dtype``, ``compute_dtype``,
  ``attention*``, ``forward_layers``, ``decode_layers``, ``vocab_multiple``, ``max_seq_len``)
  from ``settings``. Without settings they take ModelConfig's defaults and ``max_seq_len`` the
  checkpoint's ``max_position_embeddings``. The checkpoint's own ``torch_dtype`` never decides
  anything: tensors are converted to ``param_dtype`` on load.
  """
  arch = _architecture(hf)
  _check_features(hf, arch)
  num_heads = int(_require_key(hf, "num_attention_heads"))
  embed_dim = int(_require_key(hf, "hidden_size"))
  architecture = {
    "vocab_size": int(_require_key(hf, "vocab_size")),
    "embed_dim": embed_dim,
    "mlp_dim": int(_require_key(hf, "intermediate_size")),
    "num_layers": int(_require_key(hf, "num_hidden_layers")),
    "num_heads": num_heads,
    "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
    "head_dim": int(hf.get("head_dim") or embed_dim // num_heads),
    "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
    "rope": _rope_config(hf),
    "qkv_bias": arch == "qwen2",
    "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
  }
  if settings is None:
    settings = ModelConfig(max_seq_len=int(hf.get("max_position_embeddings", 2048)))
  return dataclasses.replace(settings, **architecture)


def check_architecture(requested: ModelConfig, loaded: ModelConfig, where: str) -> None:
  """Raises ConfigError for an architecture key the experiment set (a non-default value) that
  the checkpoint contradicts: a model section that silently lost would mislead the user."""
  default = ModelConfig()
  for key in ARCHITECTURE_KEYS:
    mine, theirs = getattr(requested, key), getattr(loaded, key)
    if mine != getattr(default, key) and mine != theirs:
      raise ConfigError(
        f"model.{key}",
        mine,
        f"unset or {theirs!r} (with pretrained_path the architecture is {where}/config.json's)",
      )


# ----------------------------------------------------------------------------------------------
# Files


def resolve_checkpoint_dir(path: str) -> str:
  """A local directory as is; otherwise a hub repo id, downloaded (config + safetensors only)."""
  expanded = os.path.expanduser(path)
  if os.path.isdir(expanded):
    return expanded
  if os.path.exists(expanded):
    raise CheckpointError(f"{path!r} is a file; pass the checkpoint directory")
  if expanded.startswith((os.sep, ".")) or path.startswith("~") or path.count("/") != 1:
    raise CheckpointError(f"{path!r} is not a local directory, nor a hub repo id 'org/name'")
  import huggingface_hub  # only needed for hub ids

  patterns = ["config.json", "*.safetensors", _INDEX_FILE]
  return huggingface_hub.snapshot_download(repo_id=path, allow_patterns=patterns)


def _weight_files(ckpt_dir: str) -> dict[str, str]:
  """Tensor name -> safetensors file, from the shard index or the single model file."""
  index_path = os.path.join(ckpt_dir, _INDEX_FILE)
  if os.path.exists(index_path):
    with open(index_path) as fp:
      weight_map = json.load(fp)["weight_map"]
    return {name: os.path.join(ckpt_dir, file) for name, file in weight_map.items()}
  single = os.path.join(ckpt_dir, _SINGLE_FILE)
  if not os.path.exists(single):
    raise CheckpointError(
      f"{ckpt_dir} has neither {_SINGLE_FILE} nor {_INDEX_FILE} (found "
      f"{sorted(os.listdir(ckpt_dir))}); only safetensors checkpoints are supported"
    )
  with safe_open(single, framework="numpy") as fp:
    return dict.fromkeys(fp.keys(), single)


class _Tensors:
  """Checkpoint tensors by name, as safetensors slices: each shard file opened once, nothing read
  until a block is sliced. framework='numpy' keeps bf16 (as ml_dtypes.bfloat16)."""

  def __init__(self, files: Mapping[str, str], stack: contextlib.ExitStack):
    self._files, self._stack, self._open = files, stack, {}

  def __getitem__(self, name: str) -> Any:
    file = self._files[name]
    if file not in self._open:
      self._open[file] = self._stack.enter_context(safe_open(file, framework="numpy"))
    return self._open[file].get_slice(name)


# ----------------------------------------------------------------------------------------------
# Loading


def _check_names(files: Mapping[str, str], needed: list[str], cfg: ModelConfig, where: str) -> None:
  missing = sorted(set(needed) - set(files))
  if missing:
    raise CheckpointError(f"checkpoint {where} is missing tensor(s) {missing}")
  ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
  unexpected = sorted(
    n for n in set(files) - set(needed) - ignorable if not n.endswith(_IGNORED_SUFFIXES)
  )
  if unexpected:
    raise CheckpointError(
      f"checkpoint {where} has tensor(s) this decoder has no place for: {unexpected[:8]}"
      f"{' ...' if len(unexpected) > 8 else ''} (an unsupported feature?)"
    )


def _check_shapes(tensors: _Tensors, mapping: Mapping[Any, Entry], where: str) -> None:
  """Every checkpoint tensor's shape against config.json's, before anything is read."""
  for entry in mapping.values():
    for name in entry.names:
      shape = tuple(tensors[name].get_shape())
      if shape != entry.hf_shape:
        raise CheckpointError(
          f"tensor {name} in {where} has shape {shape}; config.json implies {entry.hf_shape}"
        )


def _load_one(
  tensors: _Tensors, entry: Entry, shape: tuple[int, ...], sharding: Sharding, dtype: Any
) -> jax.Array:
  """One parameter as a global array: each addressable device gets its block, read from the
  checkpoint for that block alone (a block several devices share is read once)."""
  blocks: dict[hf_layout.Spans, np.ndarray] = {}

  def block(index: tuple[slice, ...]) -> np.ndarray:
    spans = hf_layout.spans_of(index, shape)
    if spans not in blocks:
      if entry.stacked:  # [L, ...]: one checkpoint tensor per layer of the block
        (l0, l1), rest = spans[0], spans[1:]
        value = np.stack([entry.read(tensors[entry.names[i]], rest) for i in range(l0, l1)])
      else:
        value = entry.read(tensors[entry.names[0]], spans)
      blocks[spans] = value.astype(dtype)
    return blocks[spans]

  return jax.make_array_from_callback(shape, sharding, block, dtype=dtype)


def load_weights(ckpt_dir: str, cfg: ModelConfig, shardings: nnx.State | None = None) -> Decoder:
  """A Decoder for ``cfg`` whose parameters are the checkpoint's tensors (no random init).

  ``shardings`` (a tree like the Decoder's state, of ``jax.sharding.Sharding``; see
  ``parallel.mesh.state_shardings``) lays each parameter out as it is read: every process reads,
  for each of its devices, only that device's block of the checkpoint tensors (safetensors
  slices), so no device and no host ever holds a whole model, and a block goes straight to its
  device. Without ``shardings`` everything lands on the first local device. Tensors are
  converted to ``cfg.param_dtype`` (a bf16 checkpoint becomes exact float32 master weights).
  """
  files = _weight_files(ckpt_dir)
  mapping = hf_layout.tensor_map(cfg)
  _check_names(files, [n for entry in mapping.values() for n in entry.names], cfg, ckpt_dir)
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = list(nnx.to_flat_state(state))
  unmapped = sorted(str(path) for path, _ in flat if path not in mapping)
  if unmapped:  # a Decoder parameter the mapping forgot: a bug here, not in the checkpoint
    raise AssertionError(f"hf_import has no checkpoint tensor for parameters {unmapped}")
  where = {}
  if shardings is not None:
    where = {path: _value(leaf) for path, leaf in nnx.to_flat_state(shardings)}
  default = SingleDeviceSharding(jax.local_devices()[0])
  dtype = np.dtype(cfg.param_dtype.jnp)
  with contextlib.ExitStack() as stack:
    tensors = _Tensors(files, stack)
    _check_shapes(tensors, mapping, ckpt_dir)
    for path, var in flat:
      shape = tuple(var.get_value().shape)
      var.set_value(_load_one(tensors, mapping[path], shape, where.get(path, default), dtype))
  return nnx.merge(graphdef, state)


def _value(leaf: Any) -> Any:
  return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def read_config(path: str, settings: ModelConfig | None = None) -> tuple[ModelConfig, str]:
  """(ModelConfig, checkpoint directory) of a HF checkpoint, reading no weights: config.json is
  parsed and checked against ``settings``, and the weight files it needs are checked to exist."""
  ckpt_dir = resolve_checkpoint_dir(path)
  config_path = os.path.join(ckpt_dir, "config.json")
  if not os.path.exists(config_path):
    raise CheckpointError(f"{ckpt_dir} has no config.json")
  try:
    with open(config_path) as fp:
      hf = json.load(fp)
  except ValueError as e:
    raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
  cfg = model_config_from_hf(hf, settings)
  if settings is not None:
    check_architecture(settings, cfg, ckpt_dir)
  missing = sorted({f for f in _weight_files(ckpt_dir).values() if not os.path.exists(f)})
  if missing:
    raise CheckpointError(f"{ckpt_dir}: weight files named by the index are missing: {missing}")
  return cfg, ckpt_dir


def from_pretrained(path: str, settings: ModelConfig | None = None) -> tuple[ModelConfig, Decoder]:
  """(ModelConfig, Decoder) of a HF checkpoint: a local directory or a hub repo id.

  ``settings`` supplies the run-time keys (see ``model_config_from_hf``); parameters are stored
  in its ``param_dtype`` (a bf16 checkpoint loaded as float32 is upcast exactly) and computed in
  its ``compute_dtype``, independently.
  """
  cfg, ckpt_dir = read_config(path, settings)
  return cfg, load_weights(ckpt_dir, cfg)
