"""Export of a training run's policy as a Hugging Face checkpoint (``launch/export.py``).

Data flow: the workdir's newest (or a chosen) checkpoint step -> its saved config (the model's
architecture: the config's model section, or the pretrained checkpoint's config.json) -> the
policy's parameters, restored one at a time onto one local device -> ``model.hf_export`` writes
safetensors shards, config.json and the tokenizer files. The optimiser state and the reference
copy are never read, so host memory is one parameter plus one output file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from earl_jax import checkpoint, config_lib
from earl_jax import model as model_lib
from earl_jax.model import hf_export, hf_import
from earl_jax.model.config import ModelConfig, TokenizerKind
from earl_jax.parallel import mesh as mesh_lib

_PARAMS_PREFIX = ("train", "params")  # where the policy sits in the loop's checkpoint state


@dataclasses.dataclass(frozen=True)
class Exported:
  step: int
  out_dir: str
  files: list[str]
  num_params: int
  tokenizer: str  # where the tokenizer files came from, or why there are none


def _model_config(cfg: config_lib.ExperimentConfig) -> tuple[ModelConfig, dict[str, Any] | None]:
  """The run's architecture, and the config.json it started from (None: trained from scratch)."""
  if not cfg.pretrained_path:
    return cfg.model, None
  model_cfg, ckpt_dir = hf_import.read_config(cfg.pretrained_path, cfg.model)
  with open(os.path.join(ckpt_dir, "config.json")) as fp:
    return model_cfg, json.load(fp)


def _policy_params(
  ckpt: checkpoint.Checkpointer, step: int, model_cfg: ModelConfig, shardings=None
) -> Iterator[tuple[tuple[Any, ...], jax.Array]]:
  """(state path, parameter) of the policy at ``step``, each restored alone, onto the first
  local device or into ``shardings`` (a tree like the Decoder's state)."""
  abstract = nnx.state(nnx.eval_shape(lambda: model_lib.Decoder(model_cfg, rngs=nnx.Rngs(0))))
  flat = list(nnx.to_flat_state(abstract))
  keys = checkpoint.flat_names({_PARAMS_PREFIX[0]: {_PARAMS_PREFIX[1]: abstract}})
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  where = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  for (path, var), key in zip(flat, keys, strict=True):
    value = var.get_value()
    sharding = where.get(path, device)
    sharding = getattr(sharding, "get_value", lambda s=sharding: s)()
    wanted = {key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)}
    yield path, ckpt.restore_arrays(step, wanted)[key]


def _tokenizer_dir(cfg: config_lib.ExperimentConfig) -> tuple[str | None, str]:
  if cfg.tokenizer.kind != TokenizerKind.HF:
    return None, f"none: the run used the built-in '{cfg.tokenizer.kind.value}' tokenizer"
  return hf_import.resolve_checkpoint_dir(cfg.tokenizer.path), cfg.tokenizer.path


@dataclasses.dataclass(frozen=True)
class Policy:
  step: int
  config: config_lib.ExperimentConfig
  model_cfg: ModelConfig
  params: nnx.State  # the policy's parameters, on the first local device


def _open_step(ckpt: checkpoint.Checkpointer, directory: pathlib.Path, step: int | None) -> int:
  steps = ckpt.all_steps()
  if not steps or (step is not None and step not in steps):
    want = "any step" if step is None else f"step {step}"
    raise FileNotFoundError(f"no checkpoint for {want} in {directory} (steps: {steps or 'none'})")
  return steps[-1] if step is None else step


def _checkpoints(workdir: str) -> pathlib.Path:
  directory = pathlib.Path(workdir) / "checkpoints"
  if not directory.is_dir():
    raise FileNotFoundError(f"{workdir} has no checkpoints/ directory: is it a training workdir?")
  return directory


def run_config(workdir: str, *, step: int | None = None) -> config_lib.ExperimentConfig:
  """The config a training run saved with checkpoint ``step`` (default: the newest)."""
  directory = _checkpoints(workdir)
  with checkpoint.Checkpointer(directory, save_every=1, keep=10**9, async_save=False) as ckpt:
    return config_lib.from_config_dict(ckpt.read_meta(_open_step(ckpt, directory, step))["config"])


def load_policy(workdir: str, *, step: int | None = None, plan=None) -> Policy:
  """The policy of ``workdir``'s checkpoint ``step`` (default: the newest), for serving: on the
  first local device, or each parameter read straight into its sharding under ``plan``."""
  directory = _checkpoints(workdir)
  with checkpoint.Checkpointer(directory, save_every=1, keep=10**9, async_save=False) as ckpt:
    step = _open_step(ckpt, directory, step)
    cfg = config_lib.from_config_dict(ckpt.read_meta(step)["config"])
    model_cfg, _ = _model_config(cfg)
    abstract = nnx.state(nnx.eval_shape(lambda: model_lib.Decoder(model_cfg, rngs=nnx.Rngs(0))))
    shardings = None if plan is None else mesh_lib.state_shardings(abstract, plan)
    flat = dict(_policy_params(ckpt, step, model_cfg, shardings))
  params = nnx.from_flat_state(
    [(path, var.replace(flat[path])) for path, var in nnx.to_flat_state(abstract)]
  )
  return Policy(step, cfg, model_cfg, params)


def export_workdir(
  workdir: str,
  out_dir: str,
  *,
  step: int | None = None,
  dtype: str = "float32",
  max_shard_bytes: int = 2 * 2**30,
) -> Exported:
  """Writes the policy of ``workdir``'s checkpoint ``step`` (default: the newest) to ``out_dir``.

  Raises FileNotFoundError when the workdir has no checkpoint (or not that step), and
  ValueError for an unknown dtype, before anything is written.
  """
  if dtype not in hf_export.DTYPES:
    raise ValueError(f"dtype={dtype!r}; allowed: {sorted(hf_export.DTYPES)}")
  directory = _checkpoints(workdir)
  # Never saves: keep is set high so that opening it can never delete a step of a live run.
  with checkpoint.Checkpointer(directory, save_every=1, keep=10**9, async_save=False) as ckpt:
    step = _open_step(ckpt, directory, step)
    cfg = config_lib.from_config_dict(ckpt.read_meta(step)["config"])
    model_cfg, base = _model_config(cfg)
    tokenizer_dir, tokenizer = _tokenizer_dir(cfg)
    params = _policy_params(ckpt, step, model_cfg)
    tensors = hf_export.hf_tensors(model_cfg, params, dtype)
    files = hf_export.write_safetensors(tensors, out_dir, max_shard_bytes)
  hf_export.write_config(model_cfg, out_dir, dtype, base)
  if tokenizer_dir:
    files += hf_export.copy_tokenizer(tokenizer_dir, out_dir)
  return Exported(step, out_dir, ["config.json", *files], model_cfg.num_params, tokenizer)
