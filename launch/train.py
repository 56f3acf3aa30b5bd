"""Entry point: parse flags, validate the config, hand it to the trainer.

  python launch/train.py                                   # configs/connect_four_tiny.py on CPU
  python launch/train.py --config=configs/<exp>.py --config.model.num_layers=4 --workdir=/tmp/run

Kept thin on purpose: everything it calls is importable from a notebook. Until the training loop
lands (see the trainer issue) this validates and prints the resolved config and exits.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))  # so config files can `from configs import base`

from absl import app, flags  # noqa: E402
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
_WORKDIR = flags.DEFINE_string("workdir", "", "Directory for checkpoints, metrics and profiles.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = config_lib.from_config_dict(_CONFIG.value)
  except config_lib.ConfigError as e:
    # A bad config fails here, before any device is touched.
    raise app.UsageError(str(e)) from None
  print(f"config: {_CONFIG.value.to_json(indent=2)}")
  print(f"model parameters: {cfg.model.num_params:,}")
  print(f"workdir: {_WORKDIR.value or '(none)'}")


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  app.run(main)
