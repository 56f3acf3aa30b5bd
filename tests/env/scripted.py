"""Scripted text policies: stand-ins for the model in tests and sanity checks of the rollout loop.

A policy maps an observation to answer text, exactly as the model would; the scripted ones also
read their env (the board state, the problem) instead of parsing the observation back.
"""

from __future__ import annotations

from collections.abc import Callable

import pyspiel

from earl_jax.env import calculator, games

Policy = Callable[[str], str]


def _wins_now(state: pyspiel.State, action: int, player: int) -> bool:
  child = state.child(action)
  if not child.is_terminal():
    return False
  returns = child.returns()
  return returns[player] > returns[1 - player]


def heuristic_action(state: pyspiel.State, preference: Callable[[int], float]) -> int:
  """Win if possible; else a move after which the opponent cannot win at once (this blocks a
  threat, and never plays under one in Connect Four); else any move; ties by ``preference``."""
  me = state.current_player()
  legal = sorted(state.legal_actions(), key=lambda a: (preference(a), a))
  for action in legal:
    if _wins_now(state, action, me):
      return action
  for action in legal:
    child = state.child(action)
    if child.is_terminal() or not any(
      _wins_now(child, reply, 1 - me) for reply in child.legal_actions()
    ):
      return action
  return legal[0]


def game_heuristic_policy(env: games.GameEnv) -> Policy:
  """The heuristic above, answering in ``env``'s tag format."""
  tag = env.config.action_tag

  def policy(observation: str) -> str:
    del observation  # the env's state is the same information without re-parsing
    return f"<{tag}>{heuristic_action(env.state, env.spec.preference)}</{tag}>"

  return policy


def calculator_policy(env: calculator.CalculatorEnv) -> Policy:
  """Sends the problem's expression to the calculator, then answers with the tool's result."""

  def policy(observation: str) -> str:
    found = calculator.RESULT_RE.search(observation)
    if found is None:
      return f"<calc>{env.problem.expression}</calc>"
    return f"<answer>{found.group(1)}</answer>"

  return policy
