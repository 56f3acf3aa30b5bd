"""earl_jax.env: text environments for agentic RL (host side, never jitted).

``make(name, **kwargs)`` builds an env (``names()`` lists them); the multi-turn rollout
(``earl_jax.rl.rollout``) drives one env per slot. See ``base`` for the protocol, ``games`` and
``calculator`` for the observation and answer formats.
"""

import importlib
from typing import Any

# Name -> submodule. Loaded on first use, so ``earl_jax.env.base`` (the protocol the rollout
# imports) does not pull OpenSpiel and every environment in with it.
_EXPORTS = {
  "Env": "base",
  "ObservationMode": "base",
  "OnInvalid": "base",
  "Outcome": "base",
  "StepResult": "base",
  "CalculatorEnv": "calculator",
  "CalculatorEnvConfig": "calculator",
  "ProblemKind": "calculator",
  "GameEnv": "games",
  "GameEnvConfig": "games",
  "GameSpec": "games",
  "Side": "games",
  "register_game": "games",
  "OpponentKind": "opponents",
  "ParseMode": "parsing",
  "make": "registry",
  "names": "registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name not in _EXPORTS:
    raise AttributeError(f"module 'earl_jax.env' has no attribute {name!r}")
  return getattr(importlib.import_module(f"earl_jax.env.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
  return sorted([*globals(), *_EXPORTS])
