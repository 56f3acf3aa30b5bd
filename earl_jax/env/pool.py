"""Batched use of envs: N slots stepped together, as the multi-turn rollout loop drives them.

The loop resets every slot with its own seed, steps a list of actions (finished slots are
skipped), and refills a finished slot with a waiting episode via ``reset_slot``. Each finished
episode leaves an ``EpisodeStats`` record; ``summarize`` turns records into logging scalars.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

from earl_jax.env import base


@dataclasses.dataclass(frozen=True)
class EpisodeStats:
  slot: int
  seed: int
  episode_return: float  # sum of step rewards
  turns: int  # policy steps
  outcome: str  # an Outcome value


class EnvPool:
  """``num_slots`` envs from ``factory``, one episode per slot at a time."""

  def __init__(self, factory: Callable[[], base.Env], num_slots: int):
    if num_slots < 1:
      raise ValueError(f"EnvPool needs num_slots >= 1, got {num_slots}")
    self.envs = [factory() for _ in range(num_slots)]
    self._seeds: list[int | None] = [None] * num_slots
    self._returns = [0.0] * num_slots
    self._turns = [0] * num_slots
    self._done = [True] * num_slots
    self._finished: list[EpisodeStats] = []

  def __len__(self) -> int:
    return len(self.envs)

  @property
  def done(self) -> list[bool]:
    """Per slot: no episode running (finished, or never reset)."""
    return list(self._done)

  def reset(self, seeds: Sequence[int]) -> list[str]:
    """Starts one episode per slot; ``seeds[i]`` goes to slot i."""
    if len(seeds) != len(self.envs):
      raise ValueError(f"EnvPool.reset got {len(seeds)} seeds for {len(self.envs)} slots")
    return [self.reset_slot(i, seed) for i, seed in enumerate(seeds)]

  def reset_slot(self, slot: int, seed: int) -> str:
    """Starts a new episode in ``slot`` (dropping a running one) and returns its observation."""
    observation = self.envs[slot].reset(seed)
    self._seeds[slot], self._returns[slot], self._turns[slot] = seed, 0.0, 0
    self._done[slot] = False
    return observation

  def step(self, actions: Sequence[object]) -> list[base.StepResult | None]:
    """Steps every running slot with its action; finished slots get None (their action is
    ignored, so the loop may pass anything there)."""
    if len(actions) != len(self.envs):
      raise ValueError(f"EnvPool.step got {len(actions)} actions for {len(self.envs)} slots")
    results: list[base.StepResult | None] = []
    for slot, (env, action) in enumerate(zip(self.envs, actions)):
      if self._done[slot]:
        results.append(None)
        continue
      result = env.step(action)
      self._returns[slot] += result.reward
      self._turns[slot] += 1
      if result.done:
        self._done[slot] = True
        self._finished.append(
          EpisodeStats(
            slot=slot,
            seed=int(self._seeds[slot]),
            episode_return=self._returns[slot],
            turns=self._turns[slot],
            outcome=str(result.info.get("outcome")),
          )
        )
      results.append(result)
    return results

  def pop_finished(self) -> list[EpisodeStats]:
    """Records of the episodes finished since the last call, in finishing order."""
    finished, self._finished = self._finished, []
    return finished


def summarize(episodes: Sequence[EpisodeStats]) -> dict[str, float]:
  """Mean return and turns, and the fraction of each outcome, e.g. ``{"outcome/win": 0.8}``."""
  if not episodes:
    return {"episodes": 0.0}
  n = len(episodes)
  counts = collections.Counter(e.outcome for e in episodes)
  summary = {
    "episodes": float(n),
    "mean_return": sum(e.episode_return for e in episodes) / n,
    "mean_turns": sum(e.turns for e in episodes) / n,
  }
  summary.update({f"outcome/{k}": v / n for k, v in sorted(counts.items())})
  return summary
