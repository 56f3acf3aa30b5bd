"""A long-tailed agentic workload for the rollout benchmark (``benchmarks/rollout.py``).

What it models: an agent whose replies range from a few tokens to hundreds and whose episodes last
from one turn to many, as tool-using agents do (a few long turns and episodes dominate the
makespan). The policy is a random-weight decoder sampled at temperature 1 whose turn ends, at
each token, with probability ``stop_p`` (geometric reply lengths, mean ``1 / stop_p``, cut at
``max_new_tokens``); the environment answers each turn with 5-60 characters and ends the episode
after a number of turns drawn per episode (1 to ``max_turns``, geometric), optionally after a
simulated tool latency. Both are deterministic given the episode seed and the sampling key.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from earl_jax.env import base
from earl_jax.sampler import sampling


@dataclasses.dataclass(frozen=True)
class StopWithProbability:
  """Temperature-1 sampling whose token is replaced by ``stop_id`` with probability ``stop_p``."""

  stop_id: int
  stop_p: float

  def sample(self, logits_BxV: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    key, coin = jax.random.split(rng)
    tokens_B, logps_B = sampling.Temperature(1.0).sample(logits_BxV, key)
    stop_B = jax.random.uniform(coin, tokens_B.shape) < self.stop_p
    return jnp.where(stop_B, self.stop_id, tokens_B), logps_B


class LongTailEnv:
  """Episodes of 1..max_turns turns (geometric, mean ``mean_turns``); observations of 5-60
  characters; ``latency_ms`` of host time per step (a tool call)."""

  instructions = "Answer each message."

  def __init__(self, max_turns: int = 12, mean_turns: float = 3.0, latency_ms: float = 0.0):
    self.max_turns, self.mean_turns, self.latency_ms = max_turns, mean_turns, latency_ms
    self._rng = np.random.default_rng(0)
    self._turns = self._left = 0

  def _text(self) -> str:
    n = int(self._rng.integers(5, 61))
    return "".join(chr(c) for c in self._rng.integers(ord("a"), ord("z") + 1, n))

  def reset(self, seed: int) -> str:
    self._rng = np.random.default_rng(seed)
    self._left = min(self.max_turns, int(self._rng.geometric(1.0 / self.mean_turns)))
    self._turns = 0
    return self._text()

  def step(self, action_text: object) -> base.StepResult:
    del action_text
    if self.latency_ms:
      time.sleep(self.latency_ms / 1000)
    self._turns += 1
    done = self._turns >= self._left
    info = {"outcome": "done" if done else None, "legal": True, "turn": self._turns}
    return base.StepResult(self._text(), 0.0, done, info)
