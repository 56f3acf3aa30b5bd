"""Host-side scalars of a training step: rollout outcomes, evaluation rates, dispatch volumes.

Data flow: ``rl/loop.py`` turns each stage's small host metadata into the flat dict written by
``metrics.MetricsWriter``; key names follow ``earl_jax.metrics`` (reward/mean, win_rate,
context_len/mean|max, eval/<opponent>/win_rate, time/<stage>).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from earl_jax import metrics as metrics_lib
from earl_jax.parallel.dispatcher import DispatchStats
from earl_jax.rl.rollout import EpisodeStats, RolloutResult

_OUTCOMES = ("win", "draw", "loss", "invalid", "correct", "wrong", "truncated", "max_turns")


def outcome_rates(
  episodes: Sequence[EpisodeStats], prefix: str, success: str = "win"
) -> dict[str, float]:
  """Fraction of episodes per outcome (win/draw/loss/invalid/...; ``{success}_rate`` and
  ``invalid_rate`` always, the others when they occur) and invalid answers per turn."""
  n = max(len(episodes), 1)
  out = {f"{prefix}/{o}_rate": sum(e.outcome == o for e in episodes) / n for o in _OUTCOMES}
  kept = (f"{success}_rate", "invalid_rate")
  out = {k: v for k, v in out.items() if v > 0 or k.endswith(kept)}
  turns = max(sum(e.turns for e in episodes), 1)
  out[f"{prefix}/invalid_answer_rate"] = sum(e.invalid_moves for e in episodes) / turns
  out[f"{prefix}/reward"] = float(np.mean([e.reward for e in episodes])) if episodes else 0.0
  out.update(tactic_rates(episodes, prefix))
  out.update(loss_causes(episodes, prefix))
  return out


_TACTICS = (
  ("win_taken", "win_missed", "wins_taken"),
  ("block_made", "block_missed", "blocks_made"),
  ("safe_move", "unsafe_move", "safe_moves"),
)


def tactic_rates(episodes: Sequence[EpisodeStats], prefix: str) -> dict[str, float]:
  """Of the moves where a win was on offer, the fraction that took one (``wins_taken_rate``); of
  those where the opponent threatened to win next, the fraction that blocked (``blocks_made_rate``);
  of those with neither where some move would let the opponent win next, the fraction that did
  not (``safe_moves_rate``); each only where the env reports such moves (games: the step info's
  ``tactic``)."""
  out = {}
  for good, bad, name in _TACTICS:
    made = sum(e.tactics.get(good, 0) for e in episodes)
    offered = made + sum(e.tactics.get(bad, 0) for e in episodes)
    if offered:
      out[f"{prefix}/{name}_rate"] = made / offered
  return out


# The policy's last move in a lost game (its step info's tactic) -> why the game was lost.
_LOSS_CAUSES = {
  "win_missed": "missed_win",  # a win was on offer and it played elsewhere
  "block_missed": "missed_block",  # it left the opponent's threat open
  "block_made": "double_threat",  # it blocked one threat and the opponent won with another
  "unsafe_move": "opened_cell",  # its move let the opponent win next (the cell above it)
}


def loss_causes(episodes: Sequence[EpisodeStats], prefix: str) -> dict[str, float]:
  """Of all episodes, the fraction lost for each cause, read off the policy's last move:
  ``lost_missed_win_rate``, ``lost_missed_block_rate``, ``lost_double_threat_rate``,
  ``lost_opened_cell_rate``, and ``lost_other_rate`` (only when it occurs) for a loss after a
  move the env named no tactic for; they sum to ``loss_rate``. Only where the env reports
  tactics (games)."""
  if not any(e.tactics for e in episodes):
    return {}
  n = len(episodes)
  lost = [_LOSS_CAUSES.get(e.last_tactic, "other") for e in episodes if e.outcome == "loss"]
  out = {f"{prefix}/lost_{c}_rate": lost.count(c) / n for c in _LOSS_CAUSES.values()}
  if "other" in lost:
    out[f"{prefix}/lost_other_rate"] = lost.count("other") / n
  return out


def rollout_scalars(result: RolloutResult, success: str = "win") -> dict[str, Any]:
  """The rollout's row: reward, context, throughput and outcome rates; the headline rate is
  ``{success}_rate`` (``win_rate`` for games, ``correct_rate`` for the calculator)."""
  episodes = result.episodes
  lengths = np.asarray([e.context_len for e in episodes])
  turns = np.asarray([e.turns for e in episodes])
  out: dict[str, Any] = {
    metrics_lib.REWARD_KEY: float(np.mean([e.reward for e in episodes])),
    metrics_lib.REWARD_STD_KEY: float(np.std([e.reward for e in episodes])),
    metrics_lib.CONTEXT_MEAN_KEY: float(lengths.mean()),
    metrics_lib.CONTEXT_MAX_KEY: int(lengths.max()),
    "context_len/p90": float(np.percentile(lengths, 90)),
    "turns/mean": float(turns.mean()),
    "truncated_rate": float(np.mean([e.truncated for e in episodes])),
    "rollout/generated_tokens": result.generated_tokens,
    "rollout/generate_calls": result.turns,
    "rollout/episodes_per_second": len(episodes) / max(result.seconds, 1e-9),
    "batch/seq_len": int(result.batch.tokens_BxT.shape[1]),
  }
  rates = outcome_rates(episodes, "train", success)
  out[f"{success}_rate"] = rates.pop(f"train/{success}_rate")
  out.update(rates)
  out.update(opponent_rates(episodes, "train", success))
  return out


def opponent_rates(
  episodes: Sequence[EpisodeStats], prefix: str, success: str = "win"
) -> dict[str, float]:
  """``{prefix}/<opponent>/{success}_rate`` per opponent met, where episodes met more than one
  (a training mix, ``env.game.opponent_mix``); {} otherwise."""
  names = sorted({e.opponent for e in episodes if e.opponent})
  if len(names) < 2:
    return {}
  out = {}
  for name in names:
    met = [e for e in episodes if e.opponent == name]
    out[f"{prefix}/{name}/{success}_rate"] = sum(e.outcome == success for e in met) / len(met)
  return out


def dispatch_scalars(stats: DispatchStats, prefix: str) -> dict[str, float]:
  """Bytes a dispatch moved between devices (if accounted) and through the host (counted)."""
  out = {f"{prefix}/bytes_through_host": stats.bytes_through_host}
  if stats.bytes_moved is not None:
    out[f"{prefix}/bytes_moved"] = stats.bytes_moved
  if stats.seconds is not None:
    out[f"{prefix}/seconds"] = stats.seconds
  return out


def format_baselines(baselines: dict[str, Any]) -> str:
  """The ``Trainer.baselines()`` payload as a small table: a row per baseline, a column per eval
  opponent, win rates."""
  table = baselines["win_rate"]
  opponents = list(next(iter(table.values())))
  width = max(len(b) for b in table) + 2
  head = f"baselines: win rate over {baselines['episodes']} eval episodes "
  head += f"({baselines['seconds']:.1f} s), against each eval opponent"
  lines = [head, " " * width + "".join(f"{o:>11}" for o in opponents)]
  for name, row in table.items():
    lines.append(f"{name:<{width}}" + "".join(f"{row[o]:>11.3f}" for o in opponents))
  return "\n".join(lines)
