"""Two-player OpenSpiel board games as text envs; the policy plays one side, an opponent the other.

Sits between the rollout loop (text in, text out) and OpenSpiel (rules, bots). Formats, shown for
Connect Four with the policy as ``o`` (second player) after ``x`` opened in column 3:

Compact observation (default; for tiny character-level policies)::

  .......          the board as OpenSpiel renders it, top row first; x moves first
  .......
  .......
  .......
  .......
  ...x...
  o 3              your symbol, then the opponent's last move ('-' if none yet)

Moves observation (``observation="moves"``; the shortest context, for the default tiny run)::

  o 3              only your symbol and the opponent's last move: the board is the history

Columns observation (``observation="columns"``; Connect Four; the tiny default run's): the
opponent's last move, then the board column by column, each column's pieces bottom up (the
policy's ``+``, the opponent's ``-``) followed by the column's number (0-6), or by ``x`` once the
column is full::

  3 012-3456       the opponent opened in column 3: column 3 holds one of its pieces
  4 +012-3+-456    later: columns 0 and 4 hold a piece of ours; they just covered column 4's
  2 01+-+-+-x3456  column 2 is full

Each number closes its column, right after the column's top piece, and the numbers on the board
are exactly the legal moves: the answer is a number the policy reads off the board (not one it
counts separators or pieces for), and a causal model sees a column's pieces by the time it reads
the column's number.

The whole position fits in a few characters a turn and is seen from the policy's side, so the
same reply is right whichever colour it plays.

Lines observation (``observation="lines"``; Connect Four): the opponent's
last move, then for each column the cell a piece dropped there would land on, described by two
letters and closed by the column's number (or ``x`` once the column is full): the longest line
through that cell the policy would make by playing it (``a``-``d``: 1, 2, 3, 4 or more pieces) and
the longest the opponent would make by playing it (``A``-``D``)::

  3 aA0aA1aA2aB3aA4aA5aA6      the opponent opened in column 3
  2 bA0cB1dA2aD3xaA5aA6        column 2 wins now (d), column 3 must be blocked (D), 4 is full

It shows the local threats, not the board: which cells win, which must be blocked and which extend
a line. It does not say which of them matters, nor what a move gives the opponent above it: what
to make of the letters is left to the policy to learn from the rewards. They are enough to beat
the one-ply heuristic: a scripted reader that wins first, blocks second and else adds the letters
up does (tests/env/games_test.py).

Verbose observation (for chat models)::

  Connect Four. You play o. The opponent (x) played 3.
  <the board rows>
  0123456
  Legal moves: 0 1 2 4 5 6
  Answer with <move>N</move>.

The answer is ``<move>N</move>`` with N an OpenSpiel action id, i.e. the column (0-6, left to
right) in Connect Four and the cell (0-8, row by row; empty cells show their id) in Tic-Tac-Toe.
The tag name and the parser are configurable (``action_tag``, ``parse_mode``, see ``parsing``).
An invalid answer (unparseable or illegal) costs ``invalid_penalty`` and either ends the episode
(outcome ``invalid``, reward ``forfeit_reward``) or gets the short observation
``invalid; legal: 0 1 2 4 5 6`` (``invalid`` alone with the columns observation, whose board
shows the full columns) and another try, at most ``max_retries`` in a row. Terminal
observations are the final board and a line ``win``/``loss``/``draw``/``invalid`` (verbose:
``Result: ...``). Rewards: ``win_reward``, ``draw_reward``, ``loss_reward`` on the final step,
``invalid_penalty`` per invalid answer that is asked again, ``legal_move_reward`` per legal move
(a small survival signal for policies that start out answering at random: without it, every
early episode forfeits and the quickest forfeit, with the fewest penalties, scores best),
``survival_reward`` per legal move plus, on a win, once more for each move the policy would still
have had in the longest game (so a loss is worth more the longer it was held off, the signal that
teaches blocking, and every win is worth the same, so a quick win is never worth less), and
``tactic_reward`` per move that takes a win on offer or, with none, blocks a cell where the
opponent would win next (a shaping reward: it names the one-ply tactics outright). Every step's
info says which of these the move was (``tactic``: ``win_taken``, ``win_missed``, ``block_made``,
``block_missed``; in a position with neither, where some legal moves would let the opponent win
next and others would not, ``safe_move`` or ``unsafe_move``; else None), and the loop reports
the rates taken, made and kept safe.

Imitation labels (``expert_answer_bits``, for ``rl.loss.imitation_coef``) come from a scripted
expert (``expert``): ``one_ply`` names the winning moves, else the blocks, and has no opinion
elsewhere; ``two_ply`` names, in the positions with neither, the safe moves too (where some moves
would let the opponent win next: in Connect Four, by opening the cell above).

Another OpenSpiel two-player sequential game with a text rendering is added with one
``register_game`` call (see the two below).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import pyspiel

from earl_jax.env import base, opponents, parsing
from earl_jax.types import ConfigError

OpponentKind = opponents.OpponentKind


class Side(enum.Enum):
  FIRST = "first"
  SECOND = "second"
  ALTERNATE = "alternate"  # even seeds play first, odd seeds second: balanced over seed ranges


ObservationMode = base.ObservationMode


# GameEnv._position_tactic's kinds -> the step info's tactic for a move that makes it / does not.
_TACTIC_NAMES = {
  "win": ("win_taken", "win_missed"),
  "block": ("block_made", "block_missed"),
  "safe": ("safe_move", "unsafe_move"),
}


class ExpertKind(enum.Enum):
  """The scripted expert behind ``expert_answer_bits`` (the imitation term's labels)."""

  ONE_PLY = "one_ply"  # the winning moves, else the blocks; no label in quiet positions
  # ... and in a quiet position where some moves would let the opponent win next (Connect Four:
  # in the cell above), the others: the safe moves
  TWO_PLY = "two_ply"


def _default_render(state: pyspiel.State) -> str:
  return str(state).strip("\n")


@dataclasses.dataclass(frozen=True)
class GameSpec:
  """What an OpenSpiel game needs to become a text env.

  Attributes:
    openspiel_name: ``pyspiel.load_game`` name.
    title: shown in instructions and verbose observations.
    rules: one verbose sentence (how to win, what N means).
    symbols: the board symbols of player 0 and player 1 as rendered.
    render: state -> board text.
    label_row: an optional line under the board in verbose mode (e.g. column ids).
    preference: action -> sort key for the scripted heuristic (lower is preferred).
    columns: (state, policy player) -> the ``columns`` observation's board, or None when the
      game has no columns (the observation is then refused).
    lines: (state, policy player) -> the ``lines`` observation's columns, or None when the game
      has no columns (the observation is then refused).
    params: ``load_game`` parameters.
  """

  openspiel_name: str
  title: str
  rules: str
  symbols: tuple[str, str] = ("x", "o")
  render: Callable[[pyspiel.State], str] = _default_render
  label_row: str = ""
  preference: Callable[[int], float] = float
  columns: Callable[[pyspiel.State, int], str] | None = None
  lines: Callable[[pyspiel.State, int], str] | None = None
  params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def load(self) -> pyspiel.Game:
    game = pyspiel.load_game(self.openspiel_name, dict(self.params))
    kind = game.get_type()
    if game.num_players() != 2 or kind.dynamics != pyspiel.GameType.Dynamics.SEQUENTIAL:
      raise ValueError(f"{self.openspiel_name}: GameEnv needs a two-player sequential game")
    return game


GAMES: dict[str, GameSpec] = {}


def register_game(name: str, spec: GameSpec) -> None:
  """Makes ``earl_jax.env.make(name, ...)`` build a ``GameEnv`` for ``spec``."""
  if name in GAMES:
    raise ValueError(f"game {name!r} is already registered")
  GAMES[name] = spec


def _tic_tac_toe_render(state: pyspiel.State) -> str:
  # Empty cells show their action id, so the legal moves are visible on the board itself.
  flat = str(state).replace("\n", "")
  cells = [str(i) if c == "." else c for i, c in enumerate(flat)]
  return "\n".join("".join(cells[r * 3 : r * 3 + 3]) for r in range(3))


def _connect_four_columns(state: pyspiel.State, player: int) -> str:
  rows = str(state).strip("\n").splitlines()  # top row first; '.', 'x' (player 0), 'o'
  mine = "xo"[player]
  cols = []
  for c in range(len(rows[0])):
    pieces = [row[c] for row in reversed(rows) if row[c] != "."]
    end = "x" if len(pieces) == len(rows) else str(c)
    cols.append("".join("+" if p == mine else "-" for p in pieces) + end)
  return "".join(cols)


_DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))


def _connect_four_lines(state: pyspiel.State, player: int) -> str:
  board = [list(row) for row in reversed(str(state).strip("\n").splitlines())]  # bottom row first
  height, width = len(board), len(board[0])

  def longest(r: int, c: int, symbol: str) -> int:
    best = 1
    for dr, dc in _DIRECTIONS:
      n = 1
      for sign in (1, -1):
        rr, cc = r + sign * dr, c + sign * dc
        while 0 <= rr < height and 0 <= cc < width and board[rr][cc] == symbol:
          n, rr, cc = n + 1, rr + sign * dr, cc + sign * dc
      best = max(best, n)
    return min(best, 4)

  mine, theirs = "xo"[player], "xo"[1 - player]
  out = []
  for c in range(width):
    free = [r for r in range(height) if board[r][c] == "."]
    if not free:
      out.append("x")
      continue
    r = free[0]
    out.append("abcd"[longest(r, c, mine) - 1] + "ABCD"[longest(r, c, theirs) - 1] + str(c))
  return "".join(out)


register_game(
  "connect_four",
  GameSpec(
    openspiel_name="connect_four",
    title="Connect Four",
    rules="Drop a piece into column N (0-6, left to right); four in a row in any line wins.",
    label_row="0123456",
    preference=lambda a: abs(a - 3),
    columns=_connect_four_columns,
    lines=_connect_four_lines,
  ),
)
register_game(
  "tic_tac_toe",
  GameSpec(
    openspiel_name="tic_tac_toe",
    title="Tic-Tac-Toe",
    rules="Mark cell N (0-8, row by row; free cells show their number); three in a row wins.",
    render=_tic_tac_toe_render,
    preference=lambda a: 0 if a == 4 else (1 if a in (0, 2, 6, 8) else 2),
  ),
)


def _finite(value: float) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class GameEnvConfig:
  """Options of a game env (the game itself is the registry name)."""

  opponent: OpponentKind = OpponentKind.RANDOM
  # Training against several opponents: opponent specs (as train.eval_opponents: "random",
  # "heuristic", "mcts:10", ...), one drawn uniformly per episode from its seed, so a GRPO group
  # (one seed) meets one opponent and a resumed run meets the same ones. Overrides ``opponent``
  # (and ``mcts_simulations`` for an "mcts:N" spec); () = always ``opponent``.
  opponent_mix: tuple[str, ...] = ()
  mcts_simulations: int = 50  # MCTS opponent: simulations per move (strength and cost)
  mcts_rollouts: int = 1  # MCTS opponent: random rollouts per leaf evaluation
  mcts_uct_c: float = 2.0  # MCTS opponent: exploration constant
  model_side: Side = Side.ALTERNATE
  expert: ExpertKind = ExpertKind.ONE_PLY  # who labels expert_answer_bits (imitation term)
  observation: ObservationMode = ObservationMode.COMPACT
  parse_mode: parsing.ParseMode = parsing.ParseMode.TAG
  action_tag: str = "move"  # the answer is <action_tag>N</action_tag>
  on_invalid: base.OnInvalid = base.OnInvalid.RETRY
  max_retries: int = 2  # RETRY: invalid answers in a row before the episode ends as invalid
  invalid_penalty: float = -0.5  # reward of each invalid answer that is asked again
  legal_move_reward: float = 0.0  # reward of each legal move (keep 21 of them below a win)
  survival_reward: float = 0.0  # reward of each legal move and, on a win, of each move left
  tactic_reward: float = 0.0  # reward of a move that takes a win on offer, or else blocks a
  # cell where the opponent would win next (a shaping reward that names what to learn)
  forfeit_reward: float = -0.5  # reward of the invalid answer that ends the episode (outcome
  # invalid): keep it below loss_reward so that giving up is never better than playing on
  win_reward: float = 1.0
  draw_reward: float = 0.0
  loss_reward: float = -1.0

  def __post_init__(self):
    if not isinstance(self.opponent_mix, tuple):
      raise ConfigError("opponent_mix", self.opponent_mix, f"a tuple of {opponents.SPEC_HELP}")
    for spec in self.opponent_mix:
      opponents.parse_spec(spec, "opponent_mix")
    for key in ("mcts_simulations", "mcts_rollouts"):
      value = getattr(self, key)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "a positive int")
    if not _finite(self.mcts_uct_c) or self.mcts_uct_c <= 0:
      raise ConfigError("mcts_uct_c", self.mcts_uct_c, "a positive float")
    if not isinstance(self.max_retries, int) or self.max_retries < 0:
      raise ConfigError("max_retries", self.max_retries, "a non-negative int")
    if not isinstance(self.action_tag, str) or not re.fullmatch(r"[a-z_]{1,16}", self.action_tag):
      raise ConfigError("action_tag", self.action_tag, "1-16 lower-case letters or '_'")
    for key in (
      "invalid_penalty",
      "legal_move_reward",
      "survival_reward",
      "tactic_reward",
      "forfeit_reward",
      "win_reward",
      "draw_reward",
      "loss_reward",
    ):
      if not _finite(getattr(self, key)):
        raise ConfigError(key, getattr(self, key), "a finite float")
    for key, kind in (
      ("opponent", OpponentKind),
      ("model_side", Side),
      ("expert", ExpertKind),
      ("observation", ObservationMode),
      ("parse_mode", parsing.ParseMode),
      ("on_invalid", base.OnInvalid),
    ):
      if not isinstance(getattr(self, key), kind):
        raise ConfigError(key, getattr(self, key), f"one of {[m.value for m in kind]}")


class GameEnv:
  """One episode at a time of ``spec``'s game; see the module docstring for the formats."""

  def __init__(
    self,
    spec: GameSpec,
    config: GameEnvConfig | None = None,
    *,
    opponent: opponents.Opponent | None = None,
  ):
    """``opponent``: plays the other side instead of ``config.opponent`` (e.g. a person)."""
    self.spec = spec
    self.config = config or GameEnvConfig()
    self._fixed_opponent = opponent
    needs = {ObservationMode.COLUMNS: spec.columns, ObservationMode.LINES: spec.lines}
    if self.config.observation in needs and needs[self.config.observation] is None:
      raise ConfigError(
        "observation",
        self.config.observation.value,
        f"'compact', 'verbose' or 'moves' for {spec.openspiel_name}",
      )
    self._game = spec.load()
    self._guard = base.EpisodeGuard(f"GameEnv({spec.openspiel_name})")
    self._state: pyspiel.State | None = None
    self._me = 0

  @property
  def instructions(self) -> str:
    tag = self.config.action_tag
    first = self.spec.symbols[0]
    if self.config.observation is not ObservationMode.VERBOSE:
      return f"{self.spec.title}. {first} moves first. Answer <{tag}>N</{tag}>."
    return (
      f"You are playing {self.spec.title} against an opponent. {self.spec.rules} "
      f"Player {first} moves first. Each turn you see the board and answer with exactly "
      f"<{tag}>N</{tag}>, N a legal move. An invalid answer is penalised."
    )

  @property
  def answer_alphabet(self) -> tuple[str, ...] | None:
    """Every answer this env can accept, as bare text (the moves ``0..N-1``) when parse_mode is
    lenient, else None (a tagged answer is free text). ``sampler.restrict_answers`` decodes
    only these (each must be one token); which of them is legal in a position stays the policy's
    call, and an illegal one is still an invalid move."""
    if self.config.parse_mode is not parsing.ParseMode.LENIENT:
      return None
    return tuple(str(a) for a in range(self._game.num_distinct_actions()))

  def legal_answer_bits(self) -> int:
    """The legal moves now, as a mask over ``answer_alphabet`` (bit a: move a is legal); what
    ``sampler.legal_answers`` narrows each turn's decoding to. 0 when the game is over."""
    if self._state is None:
      raise RuntimeError("GameEnv.legal_answer_bits read before reset(seed)")
    if self._state.is_terminal():
      return 0
    return sum(1 << a for a in self._state.legal_actions())

  def expert_answer_bits(self) -> int:
    """What the scripted expert (``config.expert``) would answer now, as a mask over
    ``answer_alphabet``: the moves that win at once if there are any, else the moves that block a
    cell where the opponent would win next; else, with ``two_ply``, the safe moves where some
    (not all) legal moves would let the opponent win next; else 0 (no opinion). The labels of the
    imitation term (``rl.loss.imitation_coef``); the same tactics as ``info["tactic"]``."""
    if self._state is None:
      raise RuntimeError("GameEnv.expert_answer_bits read before reset(seed)")
    if self._state.is_terminal():
      return 0
    kind, moves = self._position_tactic()
    if kind == "safe" and self.config.expert is not ExpertKind.TWO_PLY:
      return 0
    return sum(1 << a for a in moves)

  @property
  def state(self) -> pyspiel.State:
    """A copy of the current OpenSpiel state (for scripted policies and tests)."""
    if self._state is None:
      raise RuntimeError("GameEnv.state read before reset(seed)")
    return self._state.clone()

  @property
  def game(self) -> pyspiel.Game:
    """The OpenSpiel game (for scripted players: search needs it)."""
    return self._game

  @property
  def model_player(self) -> int:
    return self._me

  def reset(self, seed: int) -> str:
    seed = base.check_seed(seed)
    cfg = self.config
    if cfg.model_side is Side.ALTERNATE:
      self._me = seed % 2
    else:
      self._me = 0 if cfg.model_side is Side.FIRST else 1
    self._chance_rng = base.derive_rng(seed, "chance")
    kind, sims, self._opponent_name = cfg.opponent, cfg.mcts_simulations, cfg.opponent.value
    if cfg.opponent_mix:
      spec = cfg.opponent_mix[base.derive_rng(seed, "opponent_mix").randint(len(cfg.opponent_mix))]
      self._opponent_name, overrides = opponents.parse_spec(spec, "opponent_mix")
      kind = OpponentKind(overrides["opponent"])
      sims = overrides.get("mcts_simulations", sims)
    self._opponent = self._fixed_opponent or opponents.make_opponent(
      kind,
      self._game,
      base.derive_rng(seed, "opponent"),
      mcts_simulations=sims,
      mcts_rollouts=cfg.mcts_rollouts,
      mcts_uct_c=cfg.mcts_uct_c,
    )
    self._state = self._game.new_initial_state()
    self._turn = 0
    self._moves = 0  # the policy's legal moves this episode
    self._retries = 0
    self._last_opponent: int | None = None
    self._guard.start()
    self._advance()
    return self._render()

  def step(self, action_text: object) -> base.StepResult:
    self._guard.check_running()
    self._turn += 1
    action = parsing.parse_action_int(action_text, self.config.action_tag, self.config.parse_mode)
    legal = self._state.legal_actions()
    if action is None or action not in legal:
      return self._invalid(action, legal)
    self._retries = 0
    tactic = self._tactic(action)
    self._state.apply_action(action)
    self._last_opponent = None
    self._advance()
    self._moves += 1
    per_move = self.config.legal_move_reward + self.config.survival_reward
    if tactic in ("win_taken", "block_made"):
      per_move += self.config.tactic_reward
    if self._state.is_terminal():
      outcome = self._terminal_outcome()
      if outcome is base.Outcome.WIN:  # the moves it would still have had, as if survived
        longest = (self._game.max_game_length() + (1 if self._me == 0 else 0)) // 2
        per_move += self.config.survival_reward * max(longest - self._moves, 0)
      return self._finish(outcome, action, per_move, tactic)
    reward = float(per_move)
    return base.StepResult(self._render(), reward, False, self._info(None, True, action, tactic))

  def _tactic(self, action: int) -> str | None:
    """What the policy's legal ``action`` did with the position's tactics: ``win_taken`` or
    ``win_missed`` where a move won at once, else ``block_made`` or ``block_missed`` where the
    opponent threatened to win next, else ``safe_move`` or ``unsafe_move`` where some legal move
    (not every one) would let the opponent win next, else None (a quiet position)."""
    kind, moves = self._position_tactic()
    if kind is None:
      return None
    made, missed = _TACTIC_NAMES[kind]
    return made if action in moves else missed

  def _position_tactic(self) -> tuple[str | None, list[int]]:
    """The tactic the position offers the player to move, and the moves that make it: "win" (the
    moves that win at once), else "block" (those that take a cell where the opponent would win
    next), else "safe" where some legal moves, not all, would let the opponent win next (the
    others), else (None, [])."""
    wins = opponents.winning_moves(self._state)
    if wins:
      return "win", wins
    blocks = opponents.blocking_moves(self._state)
    if blocks:
      return "block", blocks
    safe = opponents.safe_moves(self._state)
    if len(safe) < len(self._state.legal_actions()):
      return "safe", safe
    return None, []

  def _advance(self) -> None:
    """Plays chance and opponent moves until it is the policy's turn or the game is over."""
    while not self._state.is_terminal():
      if self._state.is_chance_node():
        actions, probs = zip(*self._state.chance_outcomes())
        self._state.apply_action(int(self._chance_rng.choice(actions, p=probs)))
      elif self._state.current_player() == self._me:
        return
      else:
        self._last_opponent = self._opponent(self._state)
        self._state.apply_action(self._last_opponent)

  def _terminal_outcome(self) -> base.Outcome:
    returns = self._state.returns()
    mine, theirs = returns[self._me], returns[1 - self._me]
    if mine > theirs:
      return base.Outcome.WIN
    return base.Outcome.LOSS if mine < theirs else base.Outcome.DRAW

  def _invalid(self, action: int | None, legal: list[int]) -> base.StepResult:
    cfg = self.config
    self._retries += 1
    if cfg.on_invalid is base.OnInvalid.END or self._retries > cfg.max_retries:
      return self._finish(base.Outcome.INVALID, action)
    moves = " ".join(str(a) for a in legal)
    if cfg.observation in (ObservationMode.COLUMNS, ObservationMode.LINES):
      obs = "invalid"  # the board it answered shows the full columns; keep retries short
    elif cfg.observation is not ObservationMode.VERBOSE:
      obs = f"invalid; legal: {moves}"
    else:
      what = "could not be read" if action is None else f"{action} is not legal"
      tag = cfg.action_tag
      obs = f"Invalid answer: {what}. Legal moves: {moves}. Answer with <{tag}>N</{tag}>."
    return base.StepResult(obs, float(cfg.invalid_penalty), False, self._info(None, False, action))

  def _finish(
    self,
    outcome: base.Outcome,
    action: int | None,
    bonus: float = 0.0,
    tactic: str | None = None,
  ) -> base.StepResult:
    """The last step: the outcome's reward, plus ``bonus`` (the legal move that ended it)."""
    cfg = self.config
    reward = {
      base.Outcome.WIN: cfg.win_reward,
      base.Outcome.LOSS: cfg.loss_reward,
      base.Outcome.DRAW: cfg.draw_reward,
      base.Outcome.INVALID: cfg.forfeit_reward,
    }[outcome]
    self._guard.finish()
    verdict = outcome.value
    if cfg.observation is ObservationMode.VERBOSE:
      verdict = f"Result: {verdict}."
    board = self.spec.render(self._state)
    legal = outcome is not base.Outcome.INVALID
    return base.StepResult(
      f"{board}\n{verdict}",
      float(reward) + bonus,
      True,
      self._info(outcome, legal, action, tactic),
    )

  def _info(
    self,
    outcome: base.Outcome | None,
    legal: bool,
    action: int | None,
    tactic: str | None = None,
  ) -> dict[str, Any]:
    return {
      "outcome": None if outcome is None else outcome.value,
      "legal": legal,
      "turn": self._turn,
      "action": action,
      "model_player": self._me,
      "opponent_action": self._last_opponent,
      "opponent": "given" if self._fixed_opponent else self._opponent_name,
      "retries": self._retries,
      "tactic": tactic,  # see _tactic; None for invalid answers and quiet positions
    }

  def _render(self) -> str:
    me, them = self.spec.symbols[self._me], self.spec.symbols[1 - self._me]
    last = "-" if self._last_opponent is None else str(self._last_opponent)
    if self.config.observation is ObservationMode.MOVES:
      return f"{me} {last}"
    if self.config.observation is ObservationMode.COLUMNS:
      return f"{last} {self.spec.columns(self._state, self._me)}"
    if self.config.observation is ObservationMode.LINES:
      return f"{last} {self.spec.lines(self._state, self._me)}"
    board = self.spec.render(self._state)
    if self.config.observation is ObservationMode.COMPACT:
      return f"{board}\n{me} {last}"
    if self._last_opponent is None:
      head = f"{self.spec.title}. You play {me}. You move first."
    else:
      head = f"{self.spec.title}. You play {me}. The opponent ({them}) played {last}."
    labels = f"\n{self.spec.label_row}" if self.spec.label_row else ""
    moves = " ".join(str(a) for a in self._state.legal_actions())
    tag = self.config.action_tag
    return f"{head}\n{board}{labels}\nLegal moves: {moves}\nAnswer with <{tag}>N</{tag}>."
