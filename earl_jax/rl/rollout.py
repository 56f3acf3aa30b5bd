"""The multi-turn rollout: the policy plays a batch of episodes against host-side environments.

Data flow: episodes (seed, group) --> [turn loop: generate on device, env.step on host] -->
RolloutBatch (packed, right-padded sequences) + per-episode stats. This module is the only place
where environment text meets token ids, and it is token-in/token-out: the ids the sampler produced
are the ids trained on, environment text is tokenised exactly once when it is appended, and
nothing is ever re-tokenised from decoded text.

The KV cache lives across turns: each turn only the new context (the environment's answer and the
next assistant header) is prefilled after what the row already holds. ``num_slots`` episodes run
concurrently; when one finishes, its slot is reset and the next waiting episode starts there, so
the batch stays full. An episode that would run past its token budget or the cache is truncated
and marked, never crashes the batch.

Two schedules (``RolloutConfig.batching``): ``run_rollout`` (turn) decodes a whole turn of every
slot per device call, until the slowest row stops, then steps the environments one after another;
``run_rollout_continuous`` decodes a few tokens per call, lets a slot whose turn ended leave the
batch, steps its environment on a worker thread while the others decode and inserts its next
chunk after the next call (the prefill / insert / generate programs of ``sampler/slots.py``,
passed in as ``SlotFns``). Under greedy decoding both play the same episodes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from earl_jax.env.base import Env
from earl_jax.rl import batches
from earl_jax.types import ConfigError

GenerateFn = Callable[..., tuple[Any, Any]]  # (cache, prompt, mask, positions, active, rng)
BATCHING = ("turn", "continuous")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  num_slots: int = 8  # episodes decoded concurrently (rows of the rollout batch)
  max_turns: int = 8  # model turns per episode before it is cut (outcome "max_turns")
  max_new_tokens: int = 16  # per model turn
  max_context: int = 512  # token budget of one episode (prompt + every turn); truncated beyond
  chunk_multiple: int = 16  # new-context chunks are padded up to a multiple (bounds recompiles)
  seq_multiple: int = 64  # packed sequences are padded up to a multiple (the length bucket)
  batching: str = "turn"  # turn (every row decodes until the slowest stops) | continuous
  decode_steps: int = 4  # continuous: tokens decoded per device call between slot refills

  def __post_init__(self):
    for key in (
      "num_slots",
      "max_turns",
      "max_new_tokens",
      "max_context",
      "chunk_multiple",
      "seq_multiple",
      "decode_steps",
    ):
      value = getattr(self, key)
      if value < 1:
        raise ConfigError(key, value, "a positive int")
    if self.batching not in BATCHING:
      raise ConfigError("batching", self.batching, f"one of {list(BATCHING)}")
    if self.max_new_tokens >= self.max_context:
      raise ConfigError("max_new_tokens", self.max_new_tokens, f"< max_context={self.max_context}")

  def cache_len(self) -> int:
    """The most cache slots a row can need. Rows are compact (padding takes no slot), so the
    budget is enough; a resizable cache (``run_rollout(resize=)``) grows up to it on demand."""
    return self.max_context


class TurnFormat(Protocol):
  """Turns environment text into the token ids appended to the context (once, never re-encoded)."""

  def first(self, system: str, observation: str) -> list[int]: ...

  def next(self, observation: str, stopped: bool) -> list[int]: ...

  def action_text(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
  seed: int  # env seed: determines the episode (opponent included)
  group_id: int  # episodes sharing an id form one advantage group


@dataclasses.dataclass
class EpisodeStats:
  seed: int
  group_id: int
  turns: int = 0
  context_len: int = 0
  reward: float = 0.0
  outcome: str = ""
  truncated: bool = False
  invalid_moves: int = 0
  opponent: str = ""  # the env's info["opponent"], where it names one (games)
  tactics: dict[str, int] = dataclasses.field(default_factory=dict)  # info["tactic"] -> moves
  last_tactic: str = ""  # info["tactic"] of the last turn ("" where the env named none)


@dataclasses.dataclass
class _Episode:
  spec: EpisodeSpec
  stats: EpisodeStats
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[bool] = dataclasses.field(default_factory=list)
  logps: list[float] = dataclasses.field(default_factory=list)
  answer_bits: list[int] = dataclasses.field(default_factory=list)  # per token, -1: unrestricted
  expert_bits: list[int] = dataclasses.field(default_factory=list)  # per token, 0: no label
  turn_rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (index, r)
  pending: list[int] = dataclasses.field(default_factory=list)  # context to prefill next turn


def round_up(x: int, m: int) -> int:
  """The smallest multiple of ``m`` that is >= ``x`` (chunk and length buckets)."""
  return -(-x // m) * m


@jax.jit
def _reset_rows(cache: Any, reset_B: jax.Array) -> Any:
  return cache.replace(
    valid_BxS=cache.valid_BxS & ~reset_B[:, None], end_B=jnp.where(reset_B, 0, cache.end_B)
  )


@dataclasses.dataclass
class RolloutResult:
  batch: batches.RolloutBatch
  episodes: list[EpisodeStats]
  seconds: float
  generated_tokens: int
  turns: int  # generate calls


def run_rollout(
  generate: GenerateFn,
  cache: Any,
  envs: Sequence[Env],
  fmt: TurnFormat,
  episodes: Sequence[EpisodeSpec],
  cfg: RolloutConfig,
  rng: jax.Array,
  *,
  pad_id: int,
  resize: Callable[[Any, int], Any] | None = None,
  legal_answers: bool = False,
  expert_answers: bool = False,
) -> tuple[RolloutResult, Any]:
  """Plays every episode in ``episodes``, ``cfg.num_slots`` at a time; returns the packed batch.

  Args:
    generate: the jitted engine with parameters bound: ``(cache, prompt_BxP, mask_BxP,
      positions_BxP, active_B, rng) -> (GenerateOutput, cache)``.
    cache: an empty KV cache with ``cfg.num_slots`` rows: of ``cfg.cache_len()`` slots, or any
      length when ``resize`` is given.
    envs: one environment instance per slot.
    fmt: the prompt format (chat template or the compact plain format).
    episodes: what to play; rows of the result follow this order.
    cfg: budgets.
    rng: PRNG key for sampling.
    pad_id: padding token id of the packed batch.
    resize: ``(cache, slots needed) -> cache`` with at least that many slots per row (contents
      kept). Given, the cache grows before a call whose rows need more slots than it has, up to
      ``cfg.cache_len()``, so decode attends over what the episodes fill, not the whole budget.
    legal_answers: ``generate`` takes a 7th argument, each row's answer mask for this turn
      (``env.legal_answer_bits()``: the legal moves among the env's ``answer_alphabet``), and
      the batch records it on the turn's tokens (``RolloutBatch.answer_bits_BxT``).
    expert_answers: the batch records each turn's ``env.expert_answer_bits()`` (read before the
      turn is played) on its tokens (``RolloutBatch.expert_bits_BxT``): the imitation labels.

  Returns:
    (RolloutResult, cache) — the cache is handed back so the next step can reuse its buffers.
  """
  if len(envs) != cfg.num_slots:
    raise ValueError(f"need one env per slot: {len(envs)} envs for num_slots={cfg.num_slots}")
  start = time.perf_counter()
  cache_len = cfg.cache_len() if resize is not None else cache.valid_BxS.shape[1]
  queue = collections.deque(enumerate(episodes))
  slots: list[tuple[int, _Episode] | None] = [None] * cfg.num_slots
  done: dict[int, _Episode] = {}
  generated = calls = 0
  while queue or any(slots):
    reset = _fill_slots(slots, queue, envs, fmt, cfg, cache_len, done)
    if not any(slots):
      break
    if reset.any():
      cache = _reset_rows(cache, reset)  # a host value: fine for a multi-process cache too
    if resize is not None:
      cache = _grown(cache, slots, cfg, resize)
    prompt, mask, positions, active = _chunk_arrays(slots, cfg, pad_id)
    rng, key = jax.random.split(rng)
    bits = None
    if legal_answers:
      bits = np.asarray([e.legal_answer_bits() if s else -1 for s, e in zip(slots, envs)], np.int32)
      out, cache = generate(cache, prompt, mask, positions, active, key, bits)
    else:
      out, cache = generate(cache, prompt, mask, positions, active, key)
    out = jax.device_get(out)  # B x max_new_tokens ids and log-probs: the host needs the text
    calls += 1
    expert = None
    if expert_answers:
      expert = [e.expert_answer_bits() if s else 0 for s, e in zip(slots, envs)]
    generated += _apply_outputs(slots, out, envs, fmt, cfg, cache_len, done, bits, expert)
  records = [done[i] for i in range(len(episodes))]
  batch = _pack(records, cfg, pad_id)
  result = RolloutResult(
    batch, [r.stats for r in records], time.perf_counter() - start, generated, calls
  )
  return result, cache


class SlotFns(Protocol):
  """The continuous-batching programs (``sampler/slots.py``) with the rollout's weights bound."""

  def prefill_insert(
    self, state, slots_R, fresh_R, tokens_RxP, mask_RxP, positions_RxP, budget_R
  ): ...

  def generate(self, state) -> tuple[Any, Any]: ...


def run_rollout_continuous(
  fns: SlotFns,
  state: Any,
  envs: Sequence[Env],
  fmt: TurnFormat,
  episodes: Sequence[EpisodeSpec],
  cfg: RolloutConfig,
  rng: jax.Array,
  *,
  pad_id: int,
  resize: Callable[[Any, int], Any] | None = None,
) -> tuple[RolloutResult, Any]:
  """``run_rollout`` with continuous batching: the same episodes, without waiting on slow rows.

  Each device call decodes ``cfg.decode_steps`` tokens for every live slot. A slot whose turn
  ends leaves the decode batch at once; its environment steps on a worker thread while the next
  call decodes the other slots, and its next chunk (or the next episode's first prompt) is
  prefilled and inserted right after that call. The schedule depends only on what was decoded and
  what the environments answered, never on timing, so a rollout is reproducible.

  Args are those of ``run_rollout``, except ``fns`` (the slot programs) and ``state`` (a
  ``sampler.slots.SlotState`` with ``cfg.num_slots`` slots; ``resize`` applies to its cache).
  Returns (RolloutResult, state).
  """
  if len(envs) != cfg.num_slots:
    raise ValueError(f"need one env per slot: {len(envs)} envs for num_slots={cfg.num_slots}")
  start, b = time.perf_counter(), cfg.num_slots
  run = _Continuous(cfg, envs, fmt, episodes, pad_id, resize, state.cache.max_len)
  state = state.replace(rng=rng)
  with concurrent.futures.ThreadPoolExecutor(min(b, 8), thread_name_prefix="env") as pool:
    while True:
      state = run.insert_ready(fns, state)
      if not run.live.any():
        if not run.stepping:
          break
        run.collect()  # nothing left to decode: wait for the environments now
        continue
      state, out = fns.generate(state)
      run.calls += 1
      run.collect()  # the env steps of the last call ran while this one was dispatched
      out, live, stopped = jax.device_get((out, state.live_B, state.stopped_B))
      run.record(out, live, stopped, pool)
  records = [run.done[i] for i in range(len(episodes))]
  batch = _pack(records, cfg, pad_id)
  seconds = time.perf_counter() - start
  return RolloutResult(batch, [r.stats for r in records], seconds, run.generated, run.calls), state


class _Continuous:
  """Host bookkeeping of one continuous rollout: which episode owns which slot, the turn each slot
  is decoding, the environment steps in flight and the slots ready to prefill."""

  def __init__(self, cfg, envs, fmt, episodes, pad_id, resize, cache_len):
    self.cfg, self.envs, self.fmt, self.pad_id, self.resize = cfg, envs, fmt, pad_id, resize
    self.cache_len = cfg.cache_len() if resize is not None else cache_len
    self.queue = collections.deque(enumerate(episodes))
    self.slots: list[tuple[int, _Episode] | None] = [None] * cfg.num_slots
    self.done: dict[int, _Episode] = {}
    self.turn: list[tuple[list[int], list[float]]] = [([], []) for _ in self.slots]
    self.live = np.zeros(cfg.num_slots, bool)
    self.stopped = np.zeros(cfg.num_slots, bool)
    self.stepping: dict[int, concurrent.futures.Future] = {}
    self.generated = self.calls = 0
    self.fresh = _fill_slots(self.slots, self.queue, envs, fmt, cfg, self.cache_len, self.done)
    self.ready = self.fresh.copy()

  def insert_ready(self, fns: SlotFns, state: Any) -> Any:
    """Prefills every ready slot's pending chunk in one call and sets it decoding."""
    ready = [i for i in np.flatnonzero(self.ready) if self.slots[i] is not None]
    if ready:
      if self.resize is not None:
        state = state.replace(cache=_grown(state.cache, self.slots, self.cfg, self.resize))
      n = len(ready)
      r = 1 << (n - 1).bit_length()  # rows rounded up to a power of two: few prefill shapes
      chunk = _chunk_rows([self.slots[i][1] for i in ready], r, self.cfg, self.pad_id)
      slot_ids = np.full(r, self.cfg.num_slots, np.int32)
      slot_ids[:n] = ready
      fresh = np.zeros(r, bool)
      fresh[:n] = self.fresh[ready]
      budget = np.full(r, self.cfg.max_new_tokens, np.int32)
      state = fns.prefill_insert(state, slot_ids, fresh, *chunk, budget)
      self.live[ready] = True
    self.ready[:] = False
    self.fresh[:] = False
    return state

  def record(self, out: Any, live: np.ndarray, stopped: np.ndarray, pool) -> None:
    """Appends each live slot's new tokens; a slot whose turn ended steps its env on ``pool``."""
    for i in np.flatnonzero(self.live):
      valid = out.valid_BxN[i]
      ids, logps = self.turn[i]
      ids += [int(t) for t in out.tokens_BxN[i][valid]]
      logps += [float(x) for x in out.logps_BxN[i][valid]]
      self.generated += int(valid.sum())
      if live[i]:
        continue
      self.live[i], self.stopped[i] = False, stopped[i]
      _record_turn(self.slots[i][1], ids, logps)
      self.stepping[i] = pool.submit(self.envs[i].step, self.fmt.action_text(ids))
      self.turn[i] = ([], [])

  def collect(self) -> None:
    """The env steps in flight, applied in slot order; ended episodes free their slots for the
    next queued ones."""
    for i in sorted(self.stepping):
      index, ep = self.slots[i]
      finished = _after_step(ep, self.stepping.pop(i).result(), self.fmt, self.cfg, self.stopped[i])
      if not finished and not _fits(ep, self.cfg, self.cache_len):
        _finish(ep, "truncated", truncated=True)
        finished = True
      if finished:
        self.done[index], self.slots[i] = ep, None
      else:
        self.ready[i] = True
    reset = _fill_slots(
      self.slots, self.queue, self.envs, self.fmt, self.cfg, self.cache_len, self.done
    )
    self.fresh |= reset
    self.ready |= reset


def _grown(cache: Any, slots, cfg: RolloutConfig, resize: Callable[[Any, int], Any]) -> Any:
  """``cache``, resized first if a busy row's context plus a full turn needs more slots."""
  need = max(len(s[1].tokens) + len(s[1].pending) + cfg.max_new_tokens for s in slots if s)
  return resize(cache, need) if need > cache.valid_BxS.shape[1] else cache


def _fill_slots(slots, queue, envs, fmt, cfg, cache_len, done) -> np.ndarray:
  """Starts the next queued episode in every free slot; returns the slots that were (re)set.
  An episode whose first prompt already does not fit ends at once as truncated."""
  reset = np.zeros(cfg.num_slots, bool)
  for i in range(cfg.num_slots):
    while slots[i] is None and queue:
      index, spec = queue.popleft()
      ep = _Episode(spec, EpisodeStats(seed=spec.seed, group_id=spec.group_id))
      ep.pending = fmt.first(envs[i].instructions, envs[i].reset(spec.seed))
      slots[i], reset[i] = (index, ep), True
      if not _fits(ep, cfg, cache_len):
        _finish(ep, "truncated", truncated=True)
        done[index], slots[i] = ep, None
  return reset


def _apply_outputs(slots, out, envs, fmt, cfg, cache_len, done, bits=None, expert=None) -> int:
  """Steps each busy slot's env on its reply; frees the slots whose episode ended. Returns the
  tokens generated this call. ``bits``, ``expert``: each row's answer mask and expert labels of
  this turn, if any."""
  generated = 0
  for i, slot in enumerate(slots):
    if slot is None:
      continue
    index, ep = slot
    generated += int(out.lengths_B[i])
    marks = (-1 if bits is None else int(bits[i]), 0 if expert is None else int(expert[i]))
    finished = _apply_turn(ep, envs[i], fmt, out, i, cfg, *marks)
    if not finished and not _fits(ep, cfg, cache_len):
      _finish(ep, "truncated", truncated=True)
      finished = True
    if finished:
      done[index], slots[i] = ep, None
  return generated


def _fits(ep: _Episode, cfg: RolloutConfig, cache_len: int) -> bool:
  """Whether the pending context plus a full turn fits the episode budget and the cache row.

  A cache row holds exactly the episode's tokens (padding takes no slot, see model/kv_cache.py).
  """
  return len(ep.tokens) + len(ep.pending) + cfg.max_new_tokens <= min(cfg.max_context, cache_len)


def _chunk_arrays(slots, cfg: RolloutConfig, pad_id: int):
  eps = [None if s is None else s[1] for s in slots]
  prompt, mask, positions = _chunk_rows(eps, len(slots), cfg, pad_id)
  active = np.asarray([e is not None for e in eps])
  # Host arrays: the generate callable puts them straight into its input shardings.
  return prompt, mask, positions, active


def _chunk_rows(eps: Sequence[_Episode | None], rows: int, cfg: RolloutConfig, pad_id: int):
  """[rows, P] right-padded pending chunks (P a multiple of ``cfg.chunk_multiple``), their mask
  and RoPE positions (continuing each episode's tokens); None and missing rows are padding."""
  width = max(len(e.pending) for e in eps if e is not None)
  p = round_up(width, cfg.chunk_multiple)
  prompt = np.full((rows, p), pad_id, np.int32)
  mask = np.zeros((rows, p), bool)
  positions = np.zeros((rows, p), np.int32)
  for i, ep in enumerate(eps):
    if ep is None:
      continue
    n = len(ep.pending)
    prompt[i, :n] = ep.pending
    mask[i, :n] = True
    positions[i, :n] = np.arange(len(ep.tokens), len(ep.tokens) + n)
  return prompt, mask, positions


def _apply_turn(
  ep: _Episode,
  env: Env,
  fmt: TurnFormat,
  out: Any,
  i: int,
  cfg: RolloutConfig,
  bits: int,
  expert: int = 0,
) -> bool:
  """Records the prefilled chunk and the sampled turn, steps the env; True if the episode ended."""
  n = int(out.lengths_B[i])
  ids = [int(t) for t in out.tokens_BxN[i, :n]]
  _record_turn(ep, ids, [float(x) for x in out.logps_BxN[i, :n]], bits, expert)
  return _after_step(ep, env.step(fmt.action_text(ids)), fmt, cfg, bool(out.stopped_B[i]))


def _record_turn(
  ep: _Episode, ids: list[int], logps: list[float], bits: int = -1, expert: int = 0
) -> None:
  """Appends the prefilled chunk (no loss) and the sampled turn (loss, sampler log-probs, the
  turn's answer mask and expert labels)."""
  ep.tokens += ep.pending
  ep.loss_mask += [False] * len(ep.pending)
  ep.logps += [0.0] * len(ep.pending)
  ep.answer_bits += [-1] * len(ep.pending)
  ep.expert_bits += [0] * len(ep.pending)
  ep.tokens += ids
  ep.loss_mask += [True] * len(ids)
  ep.logps += logps
  ep.answer_bits += [bits] * len(ids)
  ep.expert_bits += [expert] * len(ids)
  ep.stats.turns += 1


def _after_step(ep: _Episode, result: Any, fmt: TurnFormat, cfg: RolloutConfig, stopped: bool):
  """The env's answer to the turn just recorded; True if the episode ended."""
  ep.stats.reward += float(result.reward)
  ep.stats.opponent = str(result.info.get("opponent", ep.stats.opponent))
  tactic = result.info.get("tactic")
  if tactic:
    ep.stats.tactics[tactic] = ep.stats.tactics.get(tactic, 0) + 1
  ep.stats.last_tactic = str(tactic or "")
  ep.turn_rewards.append((len(ep.tokens) - 1, float(result.reward)))
  if result.info.get("legal") is False:
    ep.stats.invalid_moves += 1
  if result.done:
    _finish(ep, str(result.info.get("outcome")))
    return True
  if ep.stats.turns >= cfg.max_turns:
    _finish(ep, "max_turns", truncated=True)
    return True
  ep.pending = fmt.next(result.observation, stopped)
  return False


def _finish(ep: _Episode, outcome: str, *, truncated: bool = False) -> None:
  ep.stats.outcome, ep.stats.truncated = outcome, truncated
  ep.stats.context_len = len(ep.tokens)
  ep.pending = []


def _pack(records: Sequence[_Episode], cfg: RolloutConfig, pad_id: int) -> batches.RolloutBatch:
  """Packs episodes into right-padded [E, T] arrays, T bucketed to ``cfg.seq_multiple``."""
  e = len(records)
  t = round_up(max([len(r.tokens) for r in records] + [1]), cfg.seq_multiple)
  tokens = np.full((e, t), pad_id, np.int32)
  valid = np.zeros((e, t), bool)
  loss_mask = np.zeros((e, t), bool)
  logps = np.zeros((e, t), np.float32)
  token_rewards = np.zeros((e, t), np.float32)
  answer_bits = np.full((e, t), -1, np.int32)
  expert_bits = np.zeros((e, t), np.int32)
  for j, r in enumerate(records):
    n = len(r.tokens)
    answer_bits[j, :n] = r.answer_bits
    expert_bits[j, :n] = r.expert_bits
    tokens[j, :n], valid[j, :n], loss_mask[j, :n], logps[j, :n] = (
      r.tokens,
      True,
      r.loss_mask,
      r.logps,
    )
    for index, reward in r.turn_rewards:
      token_rewards[j, index] += reward
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (e, t)) * valid
  return batches.RolloutBatch(
    tokens_BxT=tokens,
    positions_BxT=positions.astype(np.int32),
    valid_BxT=valid,
    loss_mask_BxT=loss_mask,
    sampler_logps_BxT=logps,
    rewards_B=np.asarray([r.stats.reward for r in records], np.float32),
    group_ids_B=np.asarray([r.spec.group_id for r in records], np.int32),
    token_rewards_BxT=token_rewards,
    answer_bits_BxT=answer_bits,
    expert_bits_BxT=expert_bits,
  )
