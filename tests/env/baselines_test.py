"""Scripted players through the text env: opponents, baselines and their specs."""

import string

import numpy as np
import pytest

from earl_jax import config_lib
from earl_jax import env as env_lib
from earl_jax.env import baselines, opponents
from earl_jax.types import ConfigError
from tests.env import scripted

PRINTABLE = set(string.printable) - set("\t\r\x0b\x0c")


def _play(env, policy, seeds):
  pool_outcomes, texts = [], []
  for seed in seeds:
    observation = env.reset(seed)
    texts.append(observation)
    result = None
    while result is None or not result.done:
      result = env.step(policy(observation))
      observation = result.observation
      texts.append(observation)
    pool_outcomes.append(result.info["outcome"])
  return pool_outcomes, texts


def _c4(**kwargs):
  return lambda: env_lib.make("connect_four", **{"model_side": "alternate", **kwargs})


def test_heuristic_beats_random_and_random_does_not():
  seeds = range(50)
  heuristic = baselines.play("heuristic", _c4(opponent="random"), seeds)
  assert heuristic["win"] >= 0.9 and heuristic["invalid"] == 0, heuristic
  # The contrast that makes the line above meaningful: random play wins about half the games.
  assert baselines.play("random", _c4(opponent="random"), seeds)["win"] < 0.7


def test_heuristic_opponent_is_stronger_than_random():
  seeds = range(40)
  vs_random = baselines.play("random", _c4(opponent="random"), seeds)["win"]
  vs_heuristic = baselines.play("random", _c4(opponent="heuristic"), seeds)["win"]
  assert vs_heuristic < vs_random - 0.2, (vs_heuristic, vs_random)


def test_one_ply_wins_and_blocks():
  env = env_lib.make("connect_four", opponent="first_legal", model_side="first")
  rng = np.random.RandomState(0)
  env.reset(0)
  for move in (3, 3, 3):  # x stacks column 3 while the opponent stacks column 0
    env.step(f"<move>{move}</move>")
  assert opponents.one_ply(env.state, rng) == 3  # completes four
  env.reset(0)
  for move in (6, 5, 6):  # no threat of x's own; the opponent now has three in column 0
    env.step(f"<move>{move}</move>")
  assert opponents.one_ply(env.state, rng) == 0  # blocks


def test_column_baseline_forfeits_a_full_column():
  # Against an opponent that also plays column 0 first, column 0 fills; answering 0 again is
  # illegal, asked again the baseline answers the same, and the episode is forfeit.
  make = lambda: env_lib.make(  # noqa: E731
    "connect_four", opponent="first_legal", model_side="second", max_retries=1
  )
  assert baselines.play("column:0", make, range(2))["invalid"] == 1.0
  best = baselines.play("column", _c4(opponent="random"), range(40))
  assert 0 <= best["column"] <= 6 and best["win"] == max(
    baselines.play(f"column:{c}", _c4(opponent="random"), range(40))["win"] for c in range(7)
  )


def test_stack_baseline_moves_to_the_nearest_legal_column():
  # Where column:0 forfeits (the opponent fills column 0 with it), stack:0 plays on: the
  # one-column policy that legal-move masking moves off a full column.
  make = lambda: env_lib.make(  # noqa: E731
    "connect_four", opponent="first_legal", model_side="second", max_retries=1
  )
  rates = baselines.play("stack:0", make, range(2))
  assert rates["invalid"] == 0.0 and sum(rates.values()) == pytest.approx(1.0), rates
  env = make()
  env.reset(0)
  for _ in range(3):  # the opponent (first_legal) and we alternate in column 0: it is full
    env.step("<move>0</move>")
  assert 0 not in env.state.legal_actions()
  play = baselines._player("stack", 0, env, 0)
  assert play() == 1
  play = baselines._player("stack", 3, env, 0)
  assert play() == 3
  best = baselines.play("stack", _c4(opponent="random"), range(30))
  assert best["invalid"] == 0.0 and best["win"] == max(
    baselines.play(f"stack:{c}", _c4(opponent="random"), range(30))["win"] for c in range(7)
  )


def test_tic_tac_toe_heuristic_rarely_loses():
  make = lambda: env_lib.make("tic_tac_toe", opponent="random", model_side="alternate")  # noqa: E731
  rates = baselines.play("heuristic", make, range(30))
  assert rates["loss"] <= 3 / 30 and rates["win"] >= 20 / 30, rates


def test_mcts_baseline_and_table():
  cfg = config_lib.EnvConfig()
  table = cfg.baselines(("heuristic", "mcts:5"), ("random", "mcts:3"), range(6))
  assert list(table) == ["heuristic", "mcts:5"] and list(table["heuristic"]) == ["random", "mcts3"]
  assert all(0.0 <= r <= 1.0 for row in table.values() for r in row.values())


def test_observations_stay_in_the_tiny_alphabet():
  for observation in ("compact", "moves", "columns", "lines"):
    env = env_lib.make("connect_four", opponent="random", observation=observation)
    outcomes, texts = _play(
      env, lambda _, e=env: f"<move>{e.state.legal_actions()[0]}</move>", range(5)
    )
    assert all(set(t) <= PRINTABLE for t in [*texts, env.instructions]), observation
    assert "invalid" not in outcomes


@pytest.mark.parametrize("spec", ["mcts:0", "mcts:x", "random:3", "heur", "", "column:3"])
def test_bad_opponent_specs_name_the_key(spec):
  with pytest.raises(ConfigError, match="eval_opponents"):
    opponents.parse_spec(spec)


@pytest.mark.parametrize("spec", ["mcts:0", "column:x", "stack:x", "heuristic:2", "minimax", ""])
def test_bad_baseline_specs_name_the_key(spec):
  with pytest.raises(ConfigError, match="baselines"):
    baselines.parse_spec(spec)


def test_spec_names():
  assert opponents.parse_spec("mcts:25") == ("mcts25", {"opponent": "mcts", "mcts_simulations": 25})
  assert opponents.parse_spec("heuristic") == ("heuristic", {"opponent": "heuristic"})
  assert baselines.parse_spec("column:4") == ("column", 4)
  with pytest.raises(ConfigError, match="distinct"):
    config_lib.TrainConfig(eval_opponents=("mcts:5", "mcts:5"))
  with pytest.raises(ConfigError, match="calculator"):
    config_lib.ExperimentConfig(
      env=config_lib.EnvConfig(name="calculator"),
      train=config_lib.TrainConfig(baselines=("heuristic",)),
    )


def test_calculator_policy_solves_everything():
  env = env_lib.make("calculator", max_turns=2)
  outcomes, _ = _play(env, scripted.calculator_policy(env), range(30))
  assert outcomes == ["correct"] * 30
