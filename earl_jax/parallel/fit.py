"""``python -m earl_jax.parallel.fit``: the pod fit check (see ``earl_jax/fit.py``).

The check compiles the RL stage programs, so it lives above the parallel layer; this entry point
imports it only when run, and importing this module loads no RL code.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
  from earl_jax import fit
  from earl_jax.types import ConfigError

  try:
    return fit.main(argv)
  except ConfigError as e:  # bad input: one line, no traceback
    print(f"earl_jax.parallel.fit: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  raise SystemExit(main())
