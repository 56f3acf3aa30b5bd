"""Baseline policies for the game envs: the reference lines every learning curve is read against.

A baseline plays the policy's side of a ``GameEnv`` through the same text interface as the model
(it answers ``<move>N</move>``, so the env's rules, retries and forfeits apply to it too), on the
same episode seeds as the run's evaluation. Specs (``train.baselines``):

- ``random``: a uniformly random legal move;
- ``column``: one column every turn, asked again it answers the same (it forfeits when the column
  is full): what a policy that learned nothing but a column gets. The best of all columns is
  reported (``column:N`` plays column N);
- ``stack`` / ``stack:N``: the same column while it is legal, else the legal column nearest to it
  (ties to the left): what a one-column policy gets under ``sampler.legal_answers``, whose masks
  move it off a full column. Best of all columns unless N is given;
- ``heuristic``: one ply, "win if you can, block if you must", else random;
- ``mcts`` / ``mcts:N``: OpenSpiel's MCTS with the env's or N simulations per move.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from earl_jax.env import base, games, opponents
from earl_jax.types import ConfigError

SPEC_HELP = "random | column | column:N | stack | stack:N | heuristic | mcts | mcts:N"


def parse_spec(spec: str, key: str = "train.baselines") -> tuple[str, int | None]:
  """A baseline spec -> (kind, argument): ``"mcts:25"`` -> ``("mcts", 25)``."""
  kind, _, arg = spec.partition(":") if isinstance(spec, str) else ("", "", "")
  if kind not in ("random", "column", "stack", "heuristic", "mcts"):
    raise ConfigError(key, spec, SPEC_HELP)
  if arg and (kind not in ("column", "stack", "mcts") or not arg.isdigit()):
    raise ConfigError(key, spec, SPEC_HELP)
  if kind == "mcts" and arg and int(arg) < 1:
    raise ConfigError(key, spec, SPEC_HELP)
  return kind, int(arg) if arg else None


def _player(kind: str, arg: int | None, env: games.GameEnv, seed: int) -> Callable[[], int]:
  """This episode's baseline: a function of nothing (it reads ``env.state``) -> an action. Every
  kind but ``column`` and ``stack`` is the opponent of the same name, playing the policy's side."""
  if kind == "column":
    return lambda: int(arg)
  if kind == "stack":
    return lambda: min(env.state.legal_actions(), key=lambda a: (abs(a - arg), a))
  cfg = env.config
  bot = opponents.make_opponent(
    opponents.OpponentKind(kind),
    env.game,
    base.derive_rng(seed, "baseline"),
    mcts_simulations=arg or cfg.mcts_simulations,
    mcts_rollouts=cfg.mcts_rollouts,
    mcts_uct_c=cfg.mcts_uct_c,
  )
  return lambda: bot(env.state)


def play(
  spec: str, make_env: Callable[[], games.GameEnv], seeds: Sequence[int]
) -> dict[str, float]:
  """Outcome rates (``win``, ``draw``, ``loss``, ``invalid``) of baseline ``spec`` over one
  episode per seed. ``column`` or ``stack`` without N: the best column's rates, and ``column``
  its index."""
  kind, arg = parse_spec(spec)
  if kind in ("column", "stack") and arg is None:
    env = make_env()
    columns = range(env.game.num_distinct_actions())
    per_column = [play(f"{kind}:{c}", make_env, seeds) for c in columns]
    best = int(np.argmax([r["win"] for r in per_column]))
    return {**per_column[best], "column": best}
  env = make_env()
  tag = env.config.action_tag
  counts = dict.fromkeys([o.value for o in base.Outcome], 0)
  for seed in seeds:
    env.reset(seed)
    choose = _player(kind, arg, env, seed)
    while True:
      result = env.step(f"<{tag}>{choose()}</{tag}>")
      if result.done:
        counts[result.info["outcome"]] += 1
        break
  n = max(len(seeds), 1)
  return {k: v / n for k, v in counts.items() if k in ("win", "draw", "loss", "invalid")}


def table(
  specs: Sequence[str],
  suites: Sequence[tuple[str, dict[str, Any]]],
  make_env: Callable[..., games.GameEnv],
  seeds: Sequence[int],
) -> dict[str, dict[str, float]]:
  """{baseline: {suite name: win rate}} for each baseline against each evaluation suite (the
  ``(name, overrides)`` pairs of ``env.registry.evaluations``)."""
  return {
    spec: {
      name: play(spec, lambda o=overrides: make_env(**o), seeds)["win"]
      for name, overrides in suites
    }
    for spec in specs
  }
