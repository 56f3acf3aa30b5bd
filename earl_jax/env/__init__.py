"""earl_jax.env: text environments for agentic RL (host side, never jitted).

``make(name, **kwargs)`` builds an env (``names()`` lists them); the multi-turn rollout
(``earl_jax.rl.rollout``) drives one env per slot. See ``base`` for the protocol, ``games`` and
``calculator`` for the observation and answer formats.
"""

from earl_jax.env.base import Env, ObservationMode, OnInvalid, Outcome, StepResult
from earl_jax.env.calculator import CalculatorEnv, CalculatorEnvConfig, ProblemKind
from earl_jax.env.games import GameEnv, GameEnvConfig, GameSpec, Side, register_game
from earl_jax.env.opponents import OpponentKind
from earl_jax.env.parsing import ParseMode
from earl_jax.env.registry import make, names

__all__ = [
  "CalculatorEnv",
  "CalculatorEnvConfig",
  "Env",
  "GameEnv",
  "GameEnvConfig",
  "GameSpec",
  "ObservationMode",
  "OnInvalid",
  "OpponentKind",
  "Outcome",
  "ParseMode",
  "ProblemKind",
  "Side",
  "StepResult",
  "make",
  "names",
  "register_game",
]
