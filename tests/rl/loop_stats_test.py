"""Metric names per environment and the baselines table: what the rows and the bar call things."""

import pytest

from earl_jax import metrics as metrics_lib
from earl_jax.rl import loop_stats
from earl_jax.rl.rollout import EpisodeStats


def _episodes(*outcomes):
  return [
    EpisodeStats(seed=i, group_id=0, turns=4, reward=1.0, outcome=o, invalid_moves=1)
    for i, o in enumerate(outcomes)
  ]


def test_games_report_wins_and_the_calculator_reports_correct_answers():
  games = loop_stats.outcome_rates(_episodes("win", "loss"), "eval/random")
  assert games["eval/random/win_rate"] == 0.5 and "eval/random/correct_rate" not in games
  calc = loop_stats.outcome_rates(_episodes("wrong", "wrong"), "eval/calculator", "correct")
  assert calc["eval/calculator/correct_rate"] == 0.0  # kept at 0: it is the headline rate
  assert not any("win" in k or "move" in k for k in calc), calc  # no game words
  assert calc["eval/calculator/invalid_answer_rate"] == 0.25  # 1 invalid answer in 4 turns
  bar = metrics_lib.format_scalars({"correct_rate": 0.5, "eval/calculator/correct_rate": 0.25})
  assert bar == "correct 0.50 | correct[calculator] 0.25"


def test_a_training_mix_reports_the_rate_against_each_opponent():
  episodes = _episodes("win", "loss", "win", "win")
  for e, name in zip(episodes, ["heuristic", "heuristic", "random", "mcts10"]):
    e.opponent = name
  rates = loop_stats.opponent_rates(episodes, "train")
  assert rates == {
    "train/heuristic/win_rate": 0.5,
    "train/mcts10/win_rate": 1.0,
    "train/random/win_rate": 1.0,
  }
  for e in episodes:
    e.opponent = "random"
  assert loop_stats.opponent_rates(episodes, "train") == {}  # one opponent: win_rate says it all


def test_tactic_rates_count_the_moves_that_had_a_win_a_block_or_a_gift_on_offer():
  episodes = _episodes("win", "loss", "loss")
  episodes[0].tactics = {"win_taken": 1, "block_made": 2}
  episodes[1].tactics = {"block_missed": 1, "win_missed": 3}
  rates = loop_stats.outcome_rates(episodes, "eval/heuristic")
  assert rates["eval/heuristic/wins_taken_rate"] == 0.25
  assert rates["eval/heuristic/blocks_made_rate"] == pytest.approx(2 / 3)
  assert "eval/heuristic/safe_moves_rate" not in rates
  episodes[2].tactics = {"safe_move": 3, "unsafe_move": 1}
  rates = loop_stats.outcome_rates(episodes, "eval/heuristic")
  assert rates["eval/heuristic/safe_moves_rate"] == 0.75
  assert rates["eval/heuristic/wins_taken_rate"] == 0.25  # the other rates are unchanged
  episodes[0].tactics = {"block_made": 1}
  episodes[1].tactics = {}
  rates = loop_stats.outcome_rates(episodes, "train")
  assert rates["train/blocks_made_rate"] == 1.0
  assert "train/wins_taken_rate" not in rates  # no win was on offer: no rate, not a 0
  assert loop_stats.tactic_rates(_episodes("correct"), "eval/calculator") == {}


def test_loss_causes_read_the_last_move_of_each_lost_game():
  episodes = _episodes("loss", "loss", "loss", "loss", "win", "draw", "loss", "loss")
  last = ["block_missed", "block_made", "block_made", "unsafe_move", "win_taken", ""]
  for e, tactic in zip(episodes, [*last, "win_missed", "safe_move"]):
    e.last_tactic = tactic
    e.tactics = {tactic: 1} if tactic else {}
  rates = loop_stats.outcome_rates(episodes, "eval/heuristic")
  assert rates["eval/heuristic/lost_missed_block_rate"] == 1 / 8
  assert rates["eval/heuristic/lost_double_threat_rate"] == 2 / 8
  assert rates["eval/heuristic/lost_opened_cell_rate"] == 1 / 8
  assert rates["eval/heuristic/lost_missed_win_rate"] == 1 / 8
  assert rates["eval/heuristic/lost_other_rate"] == 1 / 8  # after a safe move: named, not hidden
  causes = [v for k, v in rates.items() if "/lost_" in k]
  assert sum(causes) == pytest.approx(rates["eval/heuristic/loss_rate"])
  episodes[7].last_tactic = "block_made"
  rates = loop_stats.outcome_rates(episodes, "eval/heuristic")
  assert "eval/heuristic/lost_other_rate" not in rates  # reported where it occurs
  assert rates["eval/heuristic/lost_double_threat_rate"] == 3 / 8
  calc = loop_stats.outcome_rates(_episodes("wrong", "correct"), "eval/calculator", "correct")
  assert not any("lost_" in k for k in calc)  # no tactics reported: no causes


def test_baselines_table():
  text = loop_stats.format_baselines(
    {
      "episodes": 64,
      "seconds": 2.0,
      "win_rate": {
        "column": {"random": 0.7, "mcts10": 0.5},
        "heuristic": {"random": 0.98, "mcts10": 0.6},
      },
    }
  )
  lines = text.splitlines()
  assert "64 eval episodes" in lines[0] and lines[1].split() == ["random", "mcts10"]
  assert lines[2].split() == ["column", "0.700", "0.500"]
  assert lines[3].split() == ["heuristic", "0.980", "0.600"]
