"""Scripted text policies: stand-ins for the model in tests of the rollout loop.

A policy maps an observation to answer text, exactly as the model would; the scripted ones also
read their env (the problem) instead of parsing the observation back. Game players are the
product's own (``earl_jax.env.opponents``, ``earl_jax.env.baselines``).
"""

from __future__ import annotations

from collections.abc import Callable

from earl_jax.env import calculator

Policy = Callable[[str], str]


def calculator_policy(env: calculator.CalculatorEnv) -> Policy:
  """Sends the problem's expression to the calculator, then answers with the tool's result."""

  def policy(observation: str) -> str:
    found = calculator.RESULT_RE.search(observation)
    if found is None:
      return f"<calc>{env.problem.expression}</calc>"
    return f"<answer>{found.group(1)}</answer>"

  return policy
