"""Scripted policies: the Connect Four heuristic beats the random opponent through the text env."""

import string

import numpy as np
import pytest

from earl_jax import env as env_lib
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


def test_connect_four_heuristic_beats_random():
  env = env_lib.make("connect_four", opponent="random", model_side="alternate")
  outcomes, texts = _play(env, scripted.game_heuristic_policy(env), range(50))
  assert outcomes.count("win") >= 45, outcomes
  assert "invalid" not in outcomes
  assert all(set(t) <= PRINTABLE for t in [*texts, env.instructions])  # tiny tokenizer alphabet


def test_random_policy_does_not_beat_random():
  # The contrast that makes the test above meaningful: random play wins about half the games.
  env = env_lib.make("connect_four", opponent="random", model_side="alternate")
  rng = np.random.RandomState(0)
  outcomes, _ = _play(
    env, lambda obs: f"<move>{rng.choice(env.state.legal_actions())}</move>", range(50)
  )
  assert outcomes.count("win") < 35


def test_heuristic_wins_and_blocks():
  env = env_lib.make("connect_four", opponent="first_legal", model_side="first")
  env.reset(0)
  for move in (3, 3, 3):  # x stacks column 3 while the opponent stacks column 0
    env.step(f"<move>{move}</move>")
  policy = scripted.game_heuristic_policy(env)
  assert policy("") == "<move>3</move>"  # completes four
  env.reset(0)
  for move in (6, 5, 6):  # no threat of x's own; the opponent now has three in column 0
    env.step(f"<move>{move}</move>")
  assert policy("") == "<move>0</move>"  # blocks


@pytest.mark.parametrize("name", ["tic_tac_toe"])
def test_tic_tac_toe_heuristic_rarely_loses(name):
  env = env_lib.make(name, opponent="random", model_side="alternate", observation="verbose")
  outcomes, _ = _play(env, scripted.game_heuristic_policy(env), range(30))
  assert outcomes.count("loss") <= 3 and outcomes.count("win") >= 20


def test_calculator_policy_solves_everything():
  env = env_lib.make("calculator", max_turns=2)
  outcomes, _ = _play(env, scripted.calculator_policy(env), range(30))
  assert outcomes == ["correct"] * 30
