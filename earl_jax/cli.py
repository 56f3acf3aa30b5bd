"""What the command-line launchers share: the errors that are the user's to fix (a missing
workdir or checkpoint, a bad value, an unreadable checkpoint), printed as one line, exit code 1."""

from __future__ import annotations

import sys

from earl_jax import checkpoint, config_lib
from earl_jax.model import CheckpointError

USER_ERRORS: tuple[type[BaseException], ...] = (
  FileNotFoundError,
  ValueError,
  OSError,
  CheckpointError,
  checkpoint.CheckpointError,
  config_lib.ConfigError,
)


def fail(e: BaseException | str) -> int:
  """Prints ``e`` as one line on stderr; returns the exit code."""
  print(f"earl_jax: {' '.join(str(e).split())}", file=sys.stderr)
  return 1
