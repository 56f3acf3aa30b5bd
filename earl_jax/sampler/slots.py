"""Continuous batching over decode slots: prefill, insert, generate.

Data flow: a fixed number of decode *slots* (rows of one KV cache) live in a ``SlotState``.
``prefill`` runs new context for some rows (a fresh request, or the next turn of an episode whose
row already holds a cache: the *existing prefix*) and returns a ``Prefix``; ``insert`` scatters a
prefix's rows into free slots; ``generate`` decodes a few tokens for every live slot at once. A
slot whose turn ends (a stop sequence or its token budget) leaves the decode batch at once: the
others keep decoding, and the next prefill fills it again. These are the accelerator functions of
JetStream's ``Engine`` API (``earl_jax/serve/engine.py`` wraps them) and of the continuous
rollout (``rl/rollout.py``), so serving and training decode with the same programs.

Everything here runs inside jit with static shapes; ``SlotPrograms`` holds the jitted forms.
Compared with ``sampler/engine.generate`` (one call per turn, every row decodes until the slowest
stops), the state carries each slot's next-token logits, position, budget and stop history
between calls, so rows need not start or end together.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from earl_jax.model import kv_cache as kv_lib
from earl_jax.sampler import engine as engine_lib

_NO_TOKEN = -2  # stop-history filler: matches no stop sequence


@flax.struct.dataclass
class Prefix:
  """R rows prefilled: each row's whole context so far in ``cache`` (R rows, S slots), the
  next-token logits after it and the RoPE position of the next token."""

  cache: kv_lib.KVCache
  logits_RxV: jax.Array
  pos_R: jax.Array


@flax.struct.dataclass
class SlotState:
  """Every decode slot: its cache row, next-token logits and position, whether it is decoding
  (``live_B``), tokens produced this turn against its budget, whether it hit a stop sequence,
  the last M tokens (stop matching) and the sampling key."""

  cache: kv_lib.KVCache
  logits_BxV: jax.Array
  pos_B: jax.Array
  live_B: jax.Array
  count_B: jax.Array
  budget_B: jax.Array
  stopped_B: jax.Array
  hist_BxM: jax.Array
  rng: jax.Array

  @property
  def num_slots(self) -> int:
    return self.pos_B.shape[0]


@flax.struct.dataclass
class Tokens:
  """What one ``generate`` call produced, per slot and step (N = steps): ``valid_BxN`` marks the
  tokens a live slot produced; a slot's turn ends with its last valid token."""

  tokens_BxN: jax.Array
  logps_BxN: jax.Array
  valid_BxN: jax.Array


def init_state(cache: kv_lib.KVCache, vocab_size: int, stop_len: int, rng: jax.Array) -> SlotState:
  """Empty slots over ``cache`` (its rows are the slots); nothing decodes until ``insert``."""
  b = cache.end_B.shape[0]
  return SlotState(
    cache=cache,
    logits_BxV=jnp.zeros((b, vocab_size), jnp.float32),
    pos_B=jnp.zeros((b,), jnp.int32),
    live_B=jnp.zeros((b,), jnp.bool_),
    count_B=jnp.zeros((b,), jnp.int32),
    budget_B=jnp.zeros((b,), jnp.int32),
    stopped_B=jnp.zeros((b,), jnp.bool_),
    hist_BxM=jnp.full((b, stop_len), _NO_TOKEN, jnp.int32),
    rng=rng,
  )


def rows(state: SlotState, slots_R: jax.Array, fresh_R: jax.Array) -> kv_lib.KVCache:
  """The cache rows of ``slots_R`` as the existing prefix of their next prefill; ``fresh_R`` rows
  start empty (a new request or episode in that slot). Out-of-range slots give empty rows."""
  c = state.cache
  take = functools.partial(jnp.take, indices=slots_R, mode="fill", fill_value=0)
  keep_R = ~fresh_R & (slots_R < state.num_slots)
  return kv_lib.KVCache(
    k=take(c.k, axis=1),
    v=take(c.v, axis=1),
    valid_BxS=take(c.valid_BxS, axis=0) & keep_R[:, None],
    end_B=jnp.where(keep_R, take(c.end_B, axis=0), 0),
  )


def prefill(
  model: nnx.Module,
  existing: kv_lib.KVCache,
  tokens_RxP: jax.Array,
  mask_RxP: jax.Array,
  positions_RxP: jax.Array,
) -> Prefix:
  """Appends each row's chunk (padding anywhere, marked by the mask) after its existing prefix."""
  active_R = jnp.any(mask_RxP, axis=1)
  logits_RxV, pos_R, _, cache = engine_lib.prefill_chunk(
    model, existing, tokens_RxP, mask_RxP, positions_RxP, active_R
  )
  return Prefix(cache=cache, logits_RxV=logits_RxV, pos_R=pos_R)


def insert(prefix: Prefix, state: SlotState, slots_R: jax.Array, budget_R: jax.Array) -> SlotState:
  """Puts prefix row r into slot ``slots_R[r]`` (out of range: dropped) to decode up to
  ``budget_R[r]`` tokens. The prefix's cache has the state's slot count S per row."""
  c, p = state.cache, prefix.cache
  at = functools.partial(_set_rows, slots_R=slots_R)
  cache = c.replace(
    k=at(c.k, p.k, axis=1),
    v=at(c.v, p.v, axis=1),
    valid_BxS=at(c.valid_BxS, p.valid_BxS),
    end_B=at(c.end_B, p.end_B),
  )
  r = slots_R.shape[0]
  return state.replace(
    cache=cache,
    logits_BxV=at(state.logits_BxV, prefix.logits_RxV),
    pos_B=at(state.pos_B, prefix.pos_R),
    live_B=at(state.live_B, budget_R > 0),
    count_B=at(state.count_B, jnp.zeros((r,), jnp.int32)),
    budget_B=at(state.budget_B, budget_R.astype(jnp.int32)),
    stopped_B=at(state.stopped_B, jnp.zeros((r,), jnp.bool_)),
    hist_BxM=at(state.hist_BxM, jnp.full((r, state.hist_BxM.shape[1]), _NO_TOKEN, jnp.int32)),
  )


def _set_rows(target: jax.Array, new: jax.Array, *, slots_R: jax.Array, axis: int = 0):
  index = (slice(None),) * axis + (slots_R,)
  return target.at[index].set(new.astype(target.dtype), mode="drop")


def generate(
  model: nnx.Module,
  state: SlotState,
  *,
  spec: engine_lib.GenerationSpec,
  steps: int,
) -> tuple[SlotState, Tokens]:
  """Up to ``steps`` tokens for every live slot; returns early once no slot is live.

  Each step samples from a slot's logits, feeds the token (the stop token too, so the cache holds
  the whole turn) and ends the slot's turn on a stop sequence, on its budget, or when its cache row
  is full (the token that fills the last slot is the turn's last).
  """
  b = state.num_slots
  stops_SxM, m = engine_lib.stop_table(spec)
  if state.hist_BxM.shape[1] != m:
    raise ValueError(f"SlotState keeps {state.hist_BxM.shape[1]} tokens; stop sequences need {m}")
  layers = engine_lib.decode_layers(model)
  out = Tokens(
    tokens_BxN=jnp.full((b, steps), spec.pad_id, jnp.int32),
    logps_BxN=jnp.zeros((b, steps), jnp.float32),
    valid_BxN=jnp.zeros((b, steps), jnp.bool_),
  )

  def step(carry):
    i, s, o = carry
    rng, key = jax.random.split(s.rng)
    tok_B, logp_B = spec.strategy.sample(s.logits_BxV, key)
    live_B = s.live_B
    tok_B = jnp.where(live_B, tok_B, spec.pad_id)
    hist_BxM = jnp.concatenate([s.hist_BxM[:, 1:], tok_B[:, None]], axis=1)
    match_BxS = jnp.all((hist_BxM[:, None, :] == stops_SxM[None]) | (stops_SxM[None] < 0), -1)
    hit_B = live_B & jnp.any(match_BxS, axis=-1)
    h_Bx1xD, cache = model.hidden(
      tok_B[:, None], s.pos_B[:, None], mask_BxT=live_B[:, None], cache=s.cache, layers=layers
    )
    count_B = s.count_B + live_B.astype(jnp.int32)
    full_B = cache.end_B >= cache.max_len
    s = s.replace(
      cache=cache,
      logits_BxV=model.project(h_Bx1xD)[:, 0].astype(jnp.float32),
      pos_B=s.pos_B + live_B.astype(jnp.int32),
      live_B=live_B & ~hit_B & (count_B < s.budget_B) & ~full_B,
      count_B=count_B,
      stopped_B=s.stopped_B | hit_B,
      hist_BxM=hist_BxM,
      rng=rng,
    )
    o = Tokens(
      tokens_BxN=o.tokens_BxN.at[:, i].set(tok_B),
      logps_BxN=o.logps_BxN.at[:, i].set(jnp.where(live_B, logp_B, 0.0)),
      valid_BxN=o.valid_BxN.at[:, i].set(live_B),
    )
    return i + 1, s, o

  _, state, out = jax.lax.while_loop(
    lambda c: (c[0] < steps) & jnp.any(c[1].live_B), step, (jnp.int32(0), state, out)
  )
  return state, out


@dataclasses.dataclass
class SlotPrograms:
  """The jitted slot functions for one model (graphdef) and one generation spec.

  ``params`` are passed at call time (the serving engine's ``Params``, the rollout's synced
  weights); the state is donated, so a call's input state must not be used again.
  """

  graphdef: nnx.GraphDef
  spec: engine_lib.GenerationSpec
  steps: int = 1

  def __post_init__(self):
    gd, spec = self.graphdef, self.spec

    def _prefill(params, existing, tokens, mask, positions):
      return prefill(nnx.merge(gd, params), existing, tokens, mask, positions)

    def _generate(params, state):
      return generate(nnx.merge(gd, params), state, spec=spec, steps=self.steps)

    def _prefill_insert(params, state, slots, fresh, tokens, mask, positions, budget):
      prefix = _prefill(params, rows(state, slots, fresh), tokens, mask, positions)
      return insert(prefix, state, slots, budget)

    self.prefill = jax.jit(_prefill)
    self.insert = jax.jit(insert, donate_argnums=(1,))
    self.generate = jax.jit(_generate, donate_argnums=(1,))
    self.prefill_insert = jax.jit(_prefill_insert, donate_argnums=(1,))

  def stop_len(self) -> int:
    return engine_lib.stop_table(self.spec)[1]

  def new_state(self, cache: kv_lib.KVCache, vocab_size: int, rng: jax.Array) -> SlotState:
    """Empty slots over ``cache`` for this spec's stop sequences."""
    return init_state(cache, vocab_size, self.stop_len(), rng)

  def bind(self, params: Any) -> Bound:
    return Bound(self, params)


@dataclasses.dataclass(frozen=True)
class Bound:
  """``SlotPrograms`` with the weights bound: what the continuous rollout calls."""

  programs: SlotPrograms
  params: Any

  def prefill_insert(self, state: SlotState, *args: Any) -> SlotState:
    return self.programs.prefill_insert(self.params, state, *args)

  def generate(self, state: SlotState) -> tuple[SlotState, Tokens]:
    return self.programs.generate(self.params, state)
