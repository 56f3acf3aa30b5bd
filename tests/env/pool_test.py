"""EnvPool: per-slot seeds, skipping finished slots, slot refills, episode stats."""

import pytest

from earl_jax import env as env_lib


def _pool(num_slots=3):
  return env_lib.EnvPool(
    lambda: env_lib.make("tic_tac_toe", opponent="first_legal", model_side="first"), num_slots
  )


def test_step_skips_finished_slots_and_records_episodes():
  pool = _pool()
  observations = pool.reset([0, 1, 2])
  assert len(observations) == 3 and pool.done == [False] * 3
  first = pool.step(["<move>4</move>", "garbage", "<move>4</move>"])
  assert [r.info["legal"] for r in first] == [True, False, True]
  pool.step(["<move>2</move>", "garbage", "<move>2</move>"])
  third = pool.step(["<move>6</move>", "garbage", "<move>8</move>"])
  assert third[0].info["outcome"] == "win" and third[1].info["outcome"] == "invalid"
  assert pool.done == [True, True, False]
  fourth = pool.step([None, None, "<move>6</move>"])  # finished slots ignore their action
  assert fourth[:2] == [None, None] and fourth[2].info["outcome"] == "win"
  stats = pool.pop_finished()
  assert [(s.slot, s.seed, s.outcome, s.turns) for s in stats] == [
    (0, 0, "win", 3),
    (1, 1, "invalid", 3),
    (2, 2, "win", 4),
  ]
  assert stats[1].episode_return == pytest.approx(-1.5)
  assert pool.pop_finished() == []
  summary = env_lib.summarize(stats)
  assert summary["episodes"] == 3.0
  assert summary["outcome/win"] == pytest.approx(2 / 3)
  assert summary["mean_return"] == pytest.approx((1 - 1.5 + 1) / 3)


def test_reset_slot_refills_one_episode():
  pool = _pool(2)
  pool.reset([0, 1])
  pool.step(["<move>9</move>", "<move>4</move>"])
  assert pool.reset_slot(0, 10) == "012\n345\n678\nx -"
  results = pool.step(["<move>4</move>", "<move>2</move>"])
  assert results[0].info["turn"] == 1 and results[1].info["turn"] == 2


def test_shape_errors():
  pool = _pool(2)
  with pytest.raises(ValueError, match="2 slots"):
    pool.reset([0])
  with pytest.raises(ValueError, match="2 slots"):
    pool.step(["a", "b", "c"])
  with pytest.raises(ValueError, match="num_slots"):
    env_lib.EnvPool(lambda: env_lib.make("calculator"), 0)
  assert env_lib.summarize([]) == {"episodes": 0.0}
