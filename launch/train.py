"""Entry point: parse flags, validate the config, train.

  python launch/train.py                                   # configs/connect_four_tiny.py on CPU
  python launch/train.py --config=configs/<exp>.py --config.rl.loss.kl_beta=0.01 --workdir=/tmp/run

Kept thin on purpose: everything it calls is importable from a notebook (``earl_jax.rl.loop``).
On a CPU-only machine JAX gets 8 simulated devices (``--cpu_devices``), so the per-stage layouts
are real meshes there too.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))  # so config files can `from configs import base`


def _cpu_devices(argv: list[str]) -> int:
  for i, arg in enumerate(argv):
    if arg.startswith("--cpu_devices="):
      return int(arg.split("=", 1)[1])
    if arg == "--cpu_devices" and i + 1 < len(argv):
      return int(argv[i + 1])
  return 8


if __name__ == "__main__":
  # Must be set before jax initialises its backends; only the host (CPU) platform reads it.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={_cpu_devices(sys.argv)}"
  )

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from earl_jax import config_lib  # noqa: E402


def _check_overrides(argv: list[str]) -> None:
  """Names an unknown ``--config.<key>`` override clearly (config_flags only says KeyError)."""
  path = str(_REPO / "configs" / "connect_four_tiny.py")
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith("--config="):
      path = arg.split("=", 1)[1].split(":", 1)[0]
    elif arg == "--config" and i + 1 < len(argv):
      path = argv[i + 1].split(":", 1)[0]
  spec = importlib.util.spec_from_file_location("_earl_config", path)
  if spec is None or spec.loader is None or not os.path.isfile(path):
    sys.exit(f"--config: no config file at {path!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for arg in argv[1:]:
    if not arg.startswith("--config."):
      continue
    node, walked = config, []
    for key in arg[len("--config.") :].split("=", 1)[0].split("."):
      if not hasattr(node, "keys") or key not in node:
        known = sorted(node.keys()) if hasattr(node, "keys") else []
        where = ".".join(walked) or "<root>"
        sys.exit(f"{arg}: unknown config key {key!r} under {where!r}; known keys: {known}")
      node, walked = node[key], [*walked, key]


if __name__ == "__main__":
  _check_overrides(sys.argv)  # before config_flags, which parses overrides at definition

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  str(_REPO / "configs" / "connect_four_tiny.py"),
  "Experiment config file (configs/*.py); override keys with --config.<key>=<value>.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "", "Checkpoints, metrics and profiles; default runs/<config file name>."
)
flags.DEFINE_integer("cpu_devices", 8, "Simulated devices when JAX runs on the CPU.")
_MULTIHOST = flags.DEFINE_bool(
  "multihost", False, "Call jax.distributed.initialize() (one process per host or per GPU)."
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = config_lib.from_config_dict(_CONFIG.value)
  except config_lib.ConfigError as e:
    # A bad config fails here, before any device is touched.
    raise app.UsageError(str(e)) from None
  import jax  # after the flags: XLA_FLAGS above must be in place first

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

  from earl_jax.rl import loop

  if _MULTIHOST.value:
    jax.distributed.initialize()  # reads the cluster from the environment (SLURM, TPU pods)
  config_file = pathlib.Path(config_flags.get_config_filename(flags.FLAGS["config"]))
  workdir = _WORKDIR.value or str(_REPO / "runs" / config_file.stem)
  print(f"config {config_file.name}: {cfg.model.num_params:,} parameters; workdir {workdir}")
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}")
  rows = loop.run(cfg, workdir)
  evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
  if evals:
    last = evals[-1]
    print("final evaluation:", {k: round(v, 3) for k, v in last.items() if k.startswith("eval/")})


if __name__ == "__main__":
  app.run(main)
