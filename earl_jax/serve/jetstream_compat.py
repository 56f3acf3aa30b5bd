"""The one place where earl_jax adapts JetStream 0.2.2 to the current jax and to library manners.

- JetStream frees a request's prefix after inserting it with ``jax.tree_map``, which jax removed
  (0.6); on a driver thread that AttributeError would kill the server. ``delete_pytree`` is
  replaced by the same function written with ``jax.tree.map``.
- Importing ``jetstream.core.orchestrator`` adds a DEBUG handler to the root logger (every generate
  step printed to stdout); the root logger's handlers and level are put back as they were.

Import JetStream's orchestrator from here: ``from earl_jax.serve.jetstream_compat import
orchestrator``.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

_root = logging.getLogger()
_handlers, _level = list(_root.handlers), _root.level

from jetstream.core import orchestrator  # noqa: E402

_root.handlers[:] = _handlers
_root.setLevel(_level)


def _delete_pytree(tree: Any) -> None:
  def delete(leaf):
    if isinstance(leaf, jax.Array):
      leaf.delete()

  jax.tree.map(delete, tree)


orchestrator.delete_pytree = _delete_pytree

__all__ = ["orchestrator"]
