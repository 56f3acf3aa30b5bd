"""``make(name, **kwargs)``: env construction by name, as configs and the rollout loop ask for it.

Keyword arguments are the fields of the env's config dataclass (``GameEnvConfig`` for games,
``CalculatorEnvConfig`` for ``calculator``); enum fields also take their string values, so a
plain dict from an ``ml_collections`` config works as is.
"""

from __future__ import annotations

from typing import Any

from earl_jax import config_build
from earl_jax.env import base, calculator, games
from earl_jax.types import ConfigError

CALCULATOR = "calculator"


def names() -> list[str]:
  """Every name ``make`` accepts."""
  return sorted([*games.GAMES, CALCULATOR])


def evaluations(name: str, opponents: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
  """How env ``name`` is evaluated: (metric name, config overrides) per evaluation suite.

  Games play one suite per opponent spec in ``opponents`` (``train.eval_opponents``, e.g.
  ``mcts:25``, whose metrics are named ``mcts25``; see ``opponents.parse_spec``); the calculator
  has one suite, its own problems, and no opponent.
  """
  if name == CALCULATOR:
    return [(CALCULATOR, {})]
  # Each suite plays its one opponent, whatever the training mix (env.game.opponent_mix).
  out = []
  for spec in opponents:
    metric, overrides = games.opponents.parse_spec(spec)
    out.append((metric, {**overrides, "opponent_mix": ()}))
  return out


def make(name: str, **kwargs: Any) -> base.Env:
  """Builds env ``name`` with config fields ``kwargs``; unknown names or keys raise ConfigError."""
  if name == CALCULATOR:
    config = config_build.build(calculator.CalculatorEnvConfig, kwargs, path=name)
    return calculator.CalculatorEnv(config)
  if name in games.GAMES:
    config = config_build.build(games.GameEnvConfig, kwargs, path=name)
    return games.GameEnv(games.GAMES[name], config)
  raise ConfigError("env.name", name, f"one of {names()}")
