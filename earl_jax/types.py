"""Shared vocabulary of earl_jax: stages, logical axis names and the shape-letter glossary.

Every other module imports names from here; this module imports nothing from earl_jax.

Shape letters used as suffixes in numeric code (``logits_BxTxV``, ``mask_BxT``):
  B  sequences in a batch            P  prompts            G  generations per prompt (B = P*G)
  T  tokens (sequence positions)     S  KV-cache length    D  model width (hidden size)
  H  query heads                     K  key/value heads    Dh head dimension
  F  MLP hidden size                 V  vocabulary         L  layers
  N  number of items of any other kind (a chunk count, a flat leaf count)
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import numpy as np

Array = jax.Array
PyTree = object  # A pytree of arrays; kept as an alias so signatures read as documentation.


class Stage(enum.Enum):
  """The compiled programs of one training step, each with its own parallel layout."""

  ROLLOUT = "rollout"  # policy plays multi-turn episodes (prefill + decode with a KV cache)
  REFERENCE = "reference"  # log-probs of the frozen reference and of the old policy
  UPDATE = "update"  # PPO/GRPO-style loss, gradients, optax update


# Logical axis names. Model code annotates every parameter and cache tensor with these; only the
# parallel layer maps them to mesh axes (data, fsdp, tensor), per stage.
BATCH = "batch"
SEQ = "seq"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
LAYERS = "layers"
CACHE_SEQ = "cache_seq"
NORM = "norm"  # RMSNorm scales: never sharded, named so every parameter carries a name.

LOGICAL_AXES: tuple[str, ...] = (
  BATCH,
  SEQ,
  EMBED,
  HEADS,
  KV_HEADS,
  HEAD_DIM,
  MLP,
  VOCAB,
  LAYERS,
  CACHE_SEQ,
  NORM,
)

# Mesh axis names. Exactly these three; a plan sets their sizes per stage.
DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
MESH_AXES: tuple[str, ...] = (DATA, FSDP, TENSOR)


class DType(enum.Enum):
  """Parameter / compute dtypes accepted in configs."""

  FLOAT32 = "float32"
  BFLOAT16 = "bfloat16"

  @property
  def jnp(self) -> np.dtype:
    import jax.numpy as jnp

    return jnp.dtype(self.value)


class ConfigError(ValueError):
  """A config key has a value that is not allowed. The message names key, value and the rule.

  Raised by every config dataclass (``config_lib`` and the module-owned ones such as
  ``rl.update.OptimConfig``); ``config_lib.build`` prefixes the key with its path in the config.
  """

  def __init__(self, key: str, value: Any, allowed: str):
    self.key, self.value, self.allowed = key, value, allowed
    super().__init__(f"config key '{key}' has value {value!r}; allowed: {allowed}")
