"""Game envs through their text interface: rules, invalid moves, seeding, formats."""

import re

import numpy as np
import pyspiel
import pytest

from earl_jax import env as env_lib
from earl_jax.config_lib import ConfigError
from earl_jax.env import Outcome, games, opponents

GARBAGE = [
  "",
  None,
  b"\xff\xfe\x00",
  "x" * 1_000_000,
  "<move>" * 200_000,
  "<move>7</move>",
  "<move>-1</move>",
  "<move>٣</move>",
  "<move>" + "9" * 10_000 + "</move>",
  "\ud800",
]


def _env(name="connect_four", **kwargs):
  kwargs.setdefault("opponent", "first_legal")
  kwargs.setdefault("model_side", "first")
  return env_lib.make(name, **kwargs)


def _play(env, moves, seed=0):
  env.reset(seed)
  results = [env.step(f"<move>{m}</move>") for m in moves]
  assert [r.done for r in results] == [False] * (len(moves) - 1) + [True]
  return results


def test_connect_four_vertical_win():
  results = _play(_env(), [3, 3, 3, 3])  # the first-legal opponent stacks column 0
  assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0]
  assert results[-1].info["outcome"] == "win"
  assert results[-1].observation.endswith("\nwin")


def test_connect_four_loss():
  results = _play(_env(), [6, 5, 6, 5])
  assert results[-1].info["outcome"] == "loss" and results[-1].reward == -1.0
  assert results[-1].info["opponent_action"] == 0


def test_connect_four_draw_fills_the_board():
  # Found by a depth-first search against the first-legal opponent: no four in a row, full board.
  moves = [3, 3, 3, 0, 2, 2, 2, 5, 1, 1, 2, 5, 3, 6, 6, 6, 4, 4, 5, 5, 6]
  results = _play(_env(draw_reward=0.25), moves)
  assert results[-1].info["outcome"] == "draw" and results[-1].reward == 0.25
  assert "." not in results[-1].observation


def test_connect_four_full_column_is_illegal():
  env = _env(max_retries=1)
  env.reset(0)
  for _ in range(3):
    assert env.step("<move>0</move>").info["legal"]  # x, o, x, o, x, o: no four
  assert 0 not in env.state.legal_actions()
  bad = env.step("<move>0</move>")
  assert (bad.done, bad.reward, bad.info["legal"]) == (False, -0.5, False)
  assert bad.observation == "invalid; legal: 1 2 3 4 5 6"
  ok = env.step("<move>1</move>")  # a legal move resets the retry count
  assert ok.info["legal"] and ok.info["retries"] == 0


def test_legal_answer_bits_are_the_legal_moves():
  env = _env(parse_mode="lenient")
  with pytest.raises(RuntimeError, match="before reset"):
    env.legal_answer_bits()
  env.reset(0)
  assert env.answer_alphabet == tuple("0123456") and env.legal_answer_bits() == 0b1111111
  for _ in range(3):
    env.step("0")  # with the first-legal opponent's replies column 0 fills up
  assert env.legal_answer_bits() == 0b1111110
  assert env.legal_answer_bits() == sum(1 << a for a in env.state.legal_actions())
  for move in "3333":  # a vertical four while the opponent fills column 1
    result = env.step(move)
  assert result.done and env.legal_answer_bits() == 0  # a finished game has no legal move


def test_invalid_ends_the_episode_when_configured():
  env = _env(on_invalid="end", invalid_penalty=-0.5, forfeit_reward=-2.0)
  env.reset(0)
  result = env.step("<move>7</move>")
  # The answer that ends the episode costs the forfeit reward, not the retry penalty.
  assert (result.done, result.reward, result.info["outcome"]) == (True, -2.0, "invalid")


def test_retries_are_bounded():
  env = _env(max_retries=2, forfeit_reward=-3.0)
  env.reset(0)
  results = [env.step("nonsense") for _ in range(3)]
  assert [r.done for r in results] == [False, False, True]
  assert [r.reward for r in results] == [-0.5, -0.5, -3.0]
  assert results[-1].info["outcome"] == Outcome.INVALID.value
  with pytest.raises(RuntimeError, match="reset"):
    env.step("<move>3</move>")


@pytest.mark.parametrize("mode", ["tag", "lenient"])
@pytest.mark.parametrize("value", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_never_raises(value, mode):
  env = _env(parse_mode=mode)
  env.reset(0)
  result = env.step(value)
  assert not result.info["legal"] and not result.done and result.reward == -0.5


@pytest.mark.parametrize("value", ["<answer>3</answer>", 3, "I will play 3 now", b"3"])
def test_lenient_mode_reads_a_bare_digit(value):
  tag_env, lenient_env = _env(), _env(parse_mode="lenient")
  tag_env.reset(0)
  lenient_env.reset(0)
  assert not tag_env.step(value).info["legal"]
  assert lenient_env.step(value).info["action"] == 3


def test_tic_tac_toe_win_draw_loss():
  win = _play(_env("tic_tac_toe"), [4, 2, 6])  # opponent takes 0, 1: x wins on the 2-4-6 diagonal
  assert win[-1].info["outcome"] == "win"
  draw = _play(_env("tic_tac_toe"), [3, 2, 4, 7, 8])
  assert draw[-1].info["outcome"] == "draw" and draw[-1].reward == 0.0
  loss = _play(_env("tic_tac_toe", model_side="second"), [3, 4])  # x takes 0, 1, 2
  assert loss[-1].info["outcome"] == "loss" and loss[-1].observation.startswith("xxx")


def test_tic_tac_toe_board_shows_free_cell_ids():
  env = _env("tic_tac_toe", model_side="second")
  assert env.reset(0) == "x12\n345\n678\no 0"
  assert env.step("<move>0</move>").info["legal"] is False  # taken


def test_sides():
  alternate = _env(model_side="alternate")
  alternate.reset(4)
  assert alternate.model_player == 0
  assert alternate.reset(7).endswith("o 0") and alternate.model_player == 1
  second = _env(model_side="second", opponent="random")
  second.reset(4)
  assert second.model_player == 1 and len(second.state.history()) == 1


def _trajectory(env, seed, moves=(3, 2, 4, 3, 1, 5)):
  observations = [env.reset(seed)]
  for move in moves:
    result = env.step(f"<move>{move}</move>")
    observations.append(result.observation)
    if result.done:
      break
  return observations


@pytest.mark.parametrize("opponent", ["random", "mcts"])
def test_reset_seed_determines_the_episode(opponent):
  env = _env(opponent=opponent, mcts_simulations=8, model_side="alternate", parse_mode="lenient")
  first = [_trajectory(env, seed) for seed in range(4)]
  assert first == [_trajectory(env, seed) for seed in range(4)]
  assert len({tuple(t) for t in first}) > 1  # seeds give different episodes


def test_opponent_mix_draws_one_opponent_per_seed():
  env = _env(opponent_mix=("random", "heuristic", "mcts:3"), model_side="alternate")
  met = {}
  for seed in range(30):
    env.reset(seed)
    met[seed] = env.step("<move>3</move>").info["opponent"]
  assert set(met.values()) == {"random", "heuristic", "mcts3"}
  for seed in range(30):  # the seed decides: a GRPO group (one seed) and a resume meet the same
    env.reset(seed)
    assert env.step("<move>3</move>").info["opponent"] == met[seed]
  plain = _env(opponent="heuristic")  # no mix: the configured opponent
  plain.reset(1)
  assert plain.step("<move>3</move>").info["opponent"] == "heuristic"
  # The heuristic of the mix is the heuristic: same seed, same moves as a plain heuristic env.
  seed = next(s for s, name in met.items() if name == "heuristic" and s % 2 == 1)
  assert _trajectory(env, seed) == _trajectory(
    _env(opponent="heuristic", model_side="alternate"), seed
  )
  for bad in (("random", "minimax"), ("mcts:0",), "random"):
    with pytest.raises(ConfigError, match="opponent_mix"):
      _env(opponent_mix=bad)


def test_evaluations_play_their_one_opponent_whatever_the_mix():
  suites = env_lib.registry.evaluations("connect_four", ("random", "mcts:5"))
  assert suites == [
    ("random", {"opponent": "random", "opponent_mix": ()}),
    ("mcts5", {"opponent": "mcts", "mcts_simulations": 5, "opponent_mix": ()}),
  ]


def test_mcts_opponent_beats_random_play():
  env = _env("tic_tac_toe", opponent="mcts", mcts_simulations=100, model_side="alternate")
  outcomes = []
  for seed in range(10):
    env.reset(seed)
    rng = np.random.RandomState(seed)
    result = None
    while result is None or not result.done:
      result = env.step(f"<move>{rng.choice(env.state.legal_actions())}</move>")
    outcomes.append(result.info["outcome"])
  # Measured 19 losses and 1 draw in 20 games; a random opponent would lose about half.
  assert outcomes.count("loss") >= 7 and outcomes.count("win") <= 1


def test_verbose_format():
  env = _env(observation="verbose", model_side="second")
  observation = env.reset(0)
  assert observation.startswith("Connect Four. You play o. The opponent (x) played 0.")
  assert "\n0123456\nLegal moves: 0 1 2 3 4 5 6\nAnswer with <move>N</move>." in observation
  assert "<move>N</move>" in env.instructions
  bad = env.step("<move>9</move>")
  assert bad.observation.startswith("Invalid answer: 9 is not legal.")


def test_custom_tag_and_compact_instructions():
  env = _env(action_tag="m")
  assert env.instructions == "Connect Four. x moves first. Answer <m>N</m>."
  env.reset(0)
  assert env.step("<m>2</m>").info["action"] == 2


def test_register_game_in_a_few_lines():
  name = "breakthrough_small_test"
  spec = games.GameSpec(
    openspiel_name="breakthrough",
    title="Breakthrough",
    rules="Move a piece; reach the far row to win.",
    params={"rows": 4, "columns": 4},
  )
  games.register_game(name, spec)
  try:
    env = env_lib.make(name, opponent="random")
    env.reset(1)
    legal = env.state.legal_actions()
    assert env.step(f"<move>{legal[0]}</move>").info["legal"]
    with pytest.raises(ValueError, match="already registered"):
      games.register_game(name, spec)
  finally:
    del games.GAMES[name]


def test_config_validation():
  with pytest.raises(ConfigError, match="mcts_simulations"):
    games.GameEnvConfig(mcts_simulations=0)
  with pytest.raises(ConfigError, match="action_tag"):
    games.GameEnvConfig(action_tag="<m>")
  with pytest.raises(ConfigError, match="invalid_penalty"):
    games.GameEnvConfig(invalid_penalty=float("nan"))
  with pytest.raises(ValueError, match="seed"):
    _env().reset(-1)


def test_moves_observation_shows_only_the_last_opponent_move():
  env = env_lib.make(
    "connect_four", observation="moves", model_side="second", opponent="first_legal"
  )
  assert env.reset(0) == "o 0"  # first_legal opened in column 0
  result = env.step("<move>3</move>")
  assert result.observation == "o 0" and not result.done  # first_legal plays 0 again
  with pytest.raises(ConfigError, match="observation"):
    env_lib.make("calculator", observation="moves")


def test_columns_observation_is_the_board_from_the_policys_side():
  env = env_lib.make(
    "connect_four", observation="columns", model_side="second", opponent="first_legal"
  )
  assert env.reset(0) == "0 -0123456"  # first_legal opened in column 0
  result = env.step("<move>3</move>")
  assert result.observation == "0 --012+3456"  # it plays 0 again; our piece sits in column 3
  assert env.step("<move>9</move>").observation == "invalid"  # the board shows what is legal
  env.step("<move>0</move>")
  # Column 0 is full (no four in it): it closes with x, not a legal number.
  assert env.step("<move>0</move>").observation == "0 --+-+-x12+3456"
  # Playing first, the same position reads the same from the policy's side: + is always ours.
  first = env_lib.make(
    "connect_four", observation="columns", model_side="first", opponent="first_legal"
  )
  assert first.reset(0) == "- 0123456"
  assert first.step("<move>3</move>").observation == "0 -012+3456"


@pytest.mark.parametrize("observation", ["columns", "lines"])
@pytest.mark.parametrize("name", ["tic_tac_toe", "calculator"])
def test_column_observations_are_refused_where_there_are_no_columns(name, observation):
  with pytest.raises(ConfigError, match="observation"):
    env_lib.make(name, observation=observation)


def test_survival_reward_pays_held_off_losses_and_the_same_for_every_win():
  env = _env(survival_reward=0.01, invalid_penalty=-0.1)  # first_legal opponent, we move first
  env.reset(0)
  rewards = [env.step(f"<move>{m}</move>").reward for m in (3, 9, 3, 3)]
  assert rewards == [0.01, -0.1, 0.01, 0.01]  # each legal move; not the retry
  # Four in column 3 on our 4th move: the win, that move, and the 17 moves we would still have
  # had (21 is the most the first player makes in a 42-move game).
  assert env.step("<move>3</move>").reward == pytest.approx(1.0 + 0.01 + 0.17)
  # A slower win is worth exactly the same in total; a loss only what it held off.
  slow = _env(survival_reward=0.01)
  slow.reset(0)
  steps = [slow.step(f"<move>{m}</move>") for m in (3, 3, 3, 0, 3)]  # blocks column 0 first
  assert steps[-1].info["outcome"] == "win"
  assert sum(r.reward for r in steps) == pytest.approx(1.0 + 0.21)
  lost = _env(survival_reward=0.01, model_side="second")
  lost.reset(0)
  results = [lost.step(f"<move>{m}</move>") for m in (6, 6, 6)]
  assert results[-1].info["outcome"] == "loss" and results[-1].done
  assert sum(r.reward for r in results) == pytest.approx(-1.0 + 0.03)


def test_each_move_names_its_tactic_and_tactic_reward_pays_wins_taken_and_blocks_made():
  # The first_legal opponent stacks column 0; we move first.
  def play(moves):
    env = _env(tactic_reward=0.1)
    env.reset(0)
    return [env.step(f"<move>{m}</move>") for m in moves]

  # Three of theirs in column 0 and no win of ours: 0 blocks, anything else misses (and loses).
  made = play((5, 6, 5, 0))
  assert [r.info["tactic"] for r in made] == [None, None, None, "block_made"]
  assert [r.reward for r in made] == [0.0, 0.0, 0.0, 0.1]
  missed = play((5, 6, 5, 4))
  assert missed[-1].info["tactic"] == "block_missed" and missed[-1].info["outcome"] == "loss"
  assert missed[-1].reward == -1.0
  # Three of ours in column 3 (and three of theirs in 0): the win comes first.
  won = play((3, 3, 3, 3))
  assert won[-1].info["tactic"] == "win_taken" and won[-1].reward == pytest.approx(1.1)
  lost = play((3, 3, 3, 0))
  assert lost[-1].info["tactic"] == "win_missed" and lost[-1].reward == 0.0
  # An invalid answer is no move: no tactic, and it is asked again.
  env = _env(tactic_reward=0.1)
  env.reset(0)
  assert env.step("<move>9</move>").info["tactic"] is None


def _random_turns(env, seeds, rng):
  """Whole games of uniformly random legal moves: per turn, (the expert's bits and the safe moves
  before it, the move, its step result)."""
  for seed in seeds:
    env.reset(seed)
    result = None
    while result is None or not result.done:
      bits, safe = env.expert_answer_bits(), opponents.safe_moves(env.state)
      move = int(rng.choice(env.state.legal_actions()))
      result = env.step(str(move))
      yield bits, safe, move, result


def test_expert_answer_bits_are_the_moves_that_make_the_tactic_and_none_in_quiet_positions():
  env = _env()
  env.reset(0)
  for m in (5, 6, 5):  # the first_legal opponent stacks column 0: three of theirs there
    assert env.expert_answer_bits() == 0  # quiet: no win, no threat
    env.step(f"<move>{m}</move>")
  assert env.expert_answer_bits() == 1 << 0  # the block
  env.reset(0)
  for m in (3, 3, 3):
    env.step(f"<move>{m}</move>")
  assert env.expert_answer_bits() == 1 << 3  # the win comes before the block in column 0
  # Over random games, a move is in the mask exactly when it takes a win or makes a block.
  rng = np.random.RandomState(0)
  env = env_lib.make("connect_four", opponent="random", parse_mode="lenient")
  labelled = 0
  for bits, _, move, result in _random_turns(env, range(30), rng):
    tactic = result.info["tactic"]
    assert (bits >> move & 1 == 1) == (tactic in ("win_taken", "block_made"))
    assert (bits == 0) == (tactic in (None, "safe_move", "unsafe_move"))
    labelled += bits != 0
  assert labelled >= 20
  assert env.expert_answer_bits() == 0  # game over


def _connect_four_after(moves):
  state = pyspiel.load_game("connect_four").new_initial_state()
  for m in moves:
    state.apply_action(m)
  return state


def test_safe_moves_leave_out_the_moves_that_open_a_win_for_the_opponent():
  # o to move; x holds row 1 in columns 3, 4 and 6. A piece of o's in column 5 lands on row 0
  # and opens row 1 of column 5, where x completes four.
  #   ...xx.x
  #   o..oo.x
  state = _connect_four_after((6, 3, 6, 0, 3, 4, 4))
  assert not opponents.winning_moves(state) and not opponents.blocking_moves(state)
  assert opponents.safe_moves(state) == [0, 1, 2, 3, 4, 6]
  assert opponents.safe_moves(_connect_four_after(())) == list(range(7))
  # Over random positions: a move is unsafe exactly when the opponent then wins in the cell
  # right above it (a drop game opens no other cell), checked here on the board itself.
  rng = np.random.RandomState(1)
  unsafe_seen = 0
  for _ in range(300):
    state = _connect_four_after(())
    for _ in range(rng.randint(4, 30)):
      if state.is_terminal() or opponents.winning_moves(state):
        break
      if not opponents.blocking_moves(state):
        safe = opponents.safe_moves(state)
        for a in state.legal_actions():
          child = state.child(a)
          above = (
            not child.is_terminal()
            and a in child.legal_actions()
            and child.child(a).is_terminal()
            and child.child(a).returns()[child.current_player()] > 0
          )
          assert (a not in safe) == above
          unsafe_seen += above
      state.apply_action(int(rng.choice(state.legal_actions())))
  assert unsafe_seen >= 20


def test_two_ply_expert_labels_the_safe_moves_where_a_move_would_open_a_win():
  # The same position through the env: we play o, a scripted opponent plays x's moves.
  for expert, label in (("one_ply", 0), ("two_ply", 0b1011111)):
    xs = iter((6, 6, 3, 4, 5))
    env = games.GameEnv(
      games.GAMES["connect_four"],
      games.GameEnvConfig(model_side=games.Side.SECOND, expert=games.ExpertKind(expert)),
      opponent=lambda state, xs=xs: next(xs),
    )
    env.reset(0)
    for m in (3, 0, 4):
      env.step(f"<move>{m}</move>")
    assert str(env.state) == str(_connect_four_after((6, 3, 6, 0, 3, 4, 4)))
    assert env.expert_answer_bits() == label
    moved = env.step("<move>5</move>")
    assert moved.info["tactic"] == "unsafe_move"
    assert moved.done and moved.info["outcome"] == "loss"  # x took row 1 of column 5
  # Over random games with two_ply: every label is a win, a block or the safe set.
  rng = np.random.RandomState(0)
  env = env_lib.make("connect_four", opponent="random", parse_mode="lenient", expert="two_ply")
  safe_labels = 0
  for bits, safe, move, result in _random_turns(env, range(80), rng):
    tactic = result.info["tactic"]
    assert (bits >> move & 1 == 1) == (tactic in ("win_taken", "block_made", "safe_move"))
    assert (bits == 0) == (tactic is None)
    if tactic in ("safe_move", "unsafe_move"):
      assert bits == sum(1 << a for a in safe)
      safe_labels += 1
  assert safe_labels >= 20


def test_lines_observation_names_each_columns_lines():
  env = env_lib.make(
    "connect_four", observation="lines", model_side="second", opponent="first_legal"
  )
  # x opened in column 0: dropped on top of it, x would make two in a column (B); so would it
  # next to it in column 1; anywhere else every piece is alone (a, A).
  assert env.reset(0) == "0 aB0aB1aA2aA3aA4aA5aA6"
  # We took 3, x took 0 again: three x in column 0 (C on top); our 3 makes 2 and 4 a pair (b).
  assert env.step("<move>3</move>").observation == "0 aC0aB1bA2bA3bA4aA5aA6"
  assert env.step("<move>9</move>").observation == "invalid"


def test_lines_observation_marks_exactly_the_winning_and_the_blocking_columns():
  # 'd' (four for the policy) where its move wins now, 'D' where the opponent's would: the
  # knowledge of the one-ply heuristic, read off random positions of random games.
  rng = np.random.RandomState(0)
  env = env_lib.make("connect_four", observation="lines", opponent="random", parse_mode="lenient")
  seen = {"d": 0, "D": 0}
  for seed in range(40):
    obs = env.reset(seed)
    while True:
      state = env.state
      me, legal = state.current_player(), state.legal_actions()
      cells = {int(col[-1]): col[:-1] for col in re.findall(r"[a-d][A-D]\d", obs.split(" ")[1])}
      assert sorted(cells) == legal, obs
      wins = {a: opponents._wins_after(state, a, me) for a in legal}
      for a in legal:
        assert (cells[a][0] == "d") == wins[a], (obs, a)
        seen["d"] += wins[a]
        # The heuristic asks by passing with another move, which it cannot do with one legal
        # move left or when that move would win: those positions say nothing about blocks.
        if len(legal) > 1 and not any(wins.values()):
          blocks = opponents._opponent_wins_at(state, a, me)
          assert (cells[a][1] == "D") == blocks, (obs, a)
          seen["D"] += blocks
      result = env.step(str(int(rng.choice(legal))))
      if result.done:
        break
      obs = result.observation
  assert seen["d"] > 10 and seen["D"] > 10, seen  # both marks were really tested


def test_the_lines_observation_alone_is_enough_to_beat_the_heuristic():
  # A scripted reader of the text only: win (d), else block (D), else the most letters, centre
  # first. What the observation offers a policy that learns to read it.
  def score(cell: tuple[str, str, str]) -> tuple:
    mine, theirs, column = cell
    lines = "abcd".index(mine) + "ABCD".index(theirs)
    return (mine == "d", theirs == "D", lines, -abs(int(column) - 3))

  def reader(obs: str) -> int:
    return int(max(re.findall(r"([a-d])([A-D])(\d)", obs.split(" ")[-1]), key=score)[2])

  env = env_lib.make(
    "connect_four", observation="lines", opponent="heuristic", parse_mode="lenient"
  )
  wins = 0
  for seed in range(40):
    obs, done = env.reset(seed), False
    while not done:
      result = env.step(str(reader(obs)))
      obs, done = result.observation, result.done
    wins += result.info["outcome"] == "win"
  assert wins / 40 >= 0.6, wins  # the heuristic itself wins about half against itself


def test_legal_move_reward_pays_each_legal_move_and_not_a_retry():
  env = _env(legal_move_reward=0.01, invalid_penalty=-0.1)
  env.reset(0)
  rewards = [env.step(f"<move>{m}</move>").reward for m in (3, 9, 3, 3)]
  assert rewards == [0.01, -0.1, 0.01, 0.01]
  assert env.step("<move>3</move>").reward == pytest.approx(1.01)  # four in column 3: win + move
