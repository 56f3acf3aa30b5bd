"""make(name, **kwargs): names, string values for enums, clear errors."""

import pytest

from earl_jax import env as env_lib
from earl_jax.config_lib import ConfigError


@pytest.mark.parametrize("name", env_lib.names())
def test_every_name_builds_an_env(name):
  env = env_lib.make(name)
  assert isinstance(env, env_lib.Env)
  assert isinstance(env.reset(0), str) and env.instructions


def test_string_values_become_enums():
  env = env_lib.make("connect_four", opponent="mcts", mcts_uct_c=1, observation="verbose")
  assert env.config.opponent is env_lib.OpponentKind.MCTS
  assert env.config.mcts_uct_c == 1.0
  calc = env_lib.make("calculator", kinds=["word"], on_malformed="end")
  assert calc.config.kinds == (env_lib.ProblemKind.WORD,)


def test_unknown_name_lists_the_names():
  with pytest.raises(ConfigError, match=r"calculator.*connect_four.*tic_tac_toe"):
    env_lib.make("chess")


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"opponnent": "random"}, r"connect_four\.opponnent.*known keys"),
    ({"opponent": "alphazero"}, r"connect_four\.opponent.*first_legal"),
    ({"mcts_simulations": "10"}, "an int"),
    ({"mcts_simulations": 0}, r"connect_four\.mcts_simulations.*positive"),
  ],
)
def test_bad_kwargs(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    env_lib.make("connect_four", **kwargs)
