"""Continuous-batching slots against the turn engine: same greedy tokens and log-probs, slots that
start, stop and restart independently, multi-turn continuation from an existing prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.sampler import engine, slots

CFG = ModelConfig(
  vocab_size=53, embed_dim=40, mlp_dim=72, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=10,
  vocab_multiple=16,
)  # fmt: skip
STOP = 7


def chunk(rows: list[list[int]], starts: list[int], multiple: int, pad_id: int):
  """Right-padded [R, P] tokens, mask and positions of new chunks (row r continues at
  ``starts[r]``); R rounded up to a power of two as the continuous rollout does, P to
  ``multiple``."""
  r = 1 << (len(rows) - 1).bit_length()
  p = -(-max(len(c) for c in rows) // multiple) * multiple
  tokens = np.full((r, p), pad_id, np.int32)
  mask = np.zeros((r, p), bool)
  positions = np.zeros((r, p), np.int32)
  for i, (c, start) in enumerate(zip(rows, starts, strict=True)):
    tokens[i, : len(c)], mask[i, : len(c)] = c, True
    positions[i, : len(c)] = np.arange(start, start + len(c))
  return tokens, mask, positions


@pytest.fixture(scope="module")
def split():
  return nnx.split(model_lib.Decoder(CFG, rngs=nnx.Rngs(0)))


def _turn_engine(split, spec, prompts, cache_len=64):
  """The turn-synchronous engine's output for ``prompts`` (a reference)."""
  graphdef, params = split
  tokens, mask, positions = chunk(prompts, [0] * len(prompts), 8, 0)
  b = tokens.shape[0]
  fn = engine.make_generate_fn(graphdef, spec)
  active = np.arange(b) < len(prompts)
  cache = model_lib.init_cache(CFG, b, cache_len)
  out, _ = fn(params, cache, tokens, mask, positions, active, jax.random.key(0))
  return jax.device_get(out)


def _slot_run(progs, params, prompts, *, num_slots, budget, cache_len=64, order=None):
  """Plays every prompt through ``num_slots`` slots, refilling a slot when its turn ends; returns
  each prompt's tokens and log-probs."""
  state = slots.init_state(
    model_lib.init_cache(CFG, num_slots, cache_len),
    CFG.padded_vocab_size,
    progs.stop_len(),
    jax.random.key(0),
  )
  queue = list(order if order is not None else range(len(prompts)))
  owner: dict[int, int] = {}
  got = {i: ([], []) for i in range(len(prompts))}
  while queue or owner:
    free = [s for s in range(num_slots) if s not in owner][: len(queue)]
    if free:
      new = [queue.pop(0) for _ in free]
      tokens, mask, positions = chunk([prompts[i] for i in new], [0] * len(new), 8, 0)
      r = tokens.shape[0]
      slot_ids = np.full(r, num_slots, np.int32)
      slot_ids[: len(free)] = free
      state = progs.prefill_insert(
        params, state, slot_ids, np.ones(r, bool), tokens, mask, positions,
        np.full(r, budget, np.int32),
      )  # fmt: skip
      owner.update(zip(free, new))
    state, out = progs.generate(params, state)
    out, live = jax.device_get((out, state.live_B))
    for s, i in list(owner.items()):
      v = out.valid_BxN[s]
      got[i][0].extend(int(t) for t in out.tokens_BxN[s][v])
      got[i][1].extend(float(x) for x in out.logps_BxN[s][v])
      if not live[s]:
        del owner[s]
  return got


@pytest.mark.parametrize("steps", [1, 3])
def test_slots_give_the_turn_engines_greedy_tokens_and_logps_with_refills(split, steps):
  prompts = [[3, 5, 7, 11, 13], [2, 4], [17, 19, 23], [1], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
  spec = engine.GenerationSpec.with_stop_ids((STOP,), max_new_tokens=6)
  want = _turn_engine(split, spec, prompts)
  progs = slots.SlotPrograms(split[0], spec, steps=steps)
  # 2 slots for 5 prompts: slots are refilled as turns end, in an order unlike the batch's.
  got = _slot_run(progs, split[1], prompts, num_slots=2, budget=6, order=[4, 1, 0, 3, 2])
  for i in range(len(prompts)):
    n = int(want.lengths_B[i])
    assert got[i][0] == [int(t) for t in want.tokens_BxN[i, :n]], i
    np.testing.assert_allclose(got[i][1], want.logps_BxN[i, :n], atol=2e-5)


def test_a_turn_continues_from_its_existing_prefix_like_the_turn_engine(split):
  """Turn 2 of a row prefilled after its turn-1 cache (``rows`` with fresh False) decodes what
  the turn engine decodes for the same two-turn context."""
  graphdef, params = split
  spec = engine.GenerationSpec(max_new_tokens=4)
  progs = slots.SlotPrograms(graphdef, spec, steps=4)
  first, second = [3, 5, 7], [9, 10]
  state = slots.init_state(
    model_lib.init_cache(CFG, 2, 32), CFG.padded_vocab_size, progs.stop_len(), jax.random.key(0)
  )
  tok, mask, pos = chunk([first], [0], 8, 0)
  state = progs.prefill_insert(params, state, np.array([1]), np.array([True]), tok, mask, pos,
                               np.array([4]))  # fmt: skip
  state, out = progs.generate(params, state)
  turn1 = [int(t) for t in np.asarray(out.tokens_BxN[1])]
  tok, mask, pos = chunk([second], [len(first) + 4], 8, 0)
  state = progs.prefill_insert(params, state, np.array([1]), np.array([False]), tok, mask, pos,
                               np.array([4]))  # fmt: skip
  state, out = progs.generate(params, state)
  turn2 = [int(t) for t in np.asarray(out.tokens_BxN[1])]
  want = _turn_engine(split, engine.GenerationSpec(max_new_tokens=4), [first + turn1 + second])
  assert turn2 == [int(t) for t in want.tokens_BxN[0]]
  assert not np.asarray(out.valid_BxN[0]).any()  # slot 0 was never filled: it produced nothing


def test_a_slot_whose_cache_row_is_full_ends_its_turn(split):
  graphdef, params = split
  progs = slots.SlotPrograms(graphdef, engine.GenerationSpec(max_new_tokens=50), steps=50)
  state = slots.init_state(
    model_lib.init_cache(CFG, 1, 12), CFG.padded_vocab_size, progs.stop_len(), jax.random.key(0)
  )
  tok, mask, pos = chunk([[1, 2, 3, 4, 5]], [0], 8, 0)
  state = progs.prefill_insert(params, state, np.array([0]), np.array([True]), tok, mask, pos,
                               np.array([50]))  # fmt: skip
  state, out = progs.generate(params, state)
  assert int(np.asarray(out.valid_BxN).sum()) == 12 - 5  # one token per free cache slot
  assert not bool(state.live_B[0]) and int(state.cache.end_B[0]) == 12


def test_insert_and_generate_leave_other_slots_untouched(split):
  graphdef, params = split
  progs = slots.SlotPrograms(graphdef, engine.GenerationSpec(max_new_tokens=3), steps=3)
  state = slots.init_state(
    model_lib.init_cache(CFG, 3, 16), CFG.padded_vocab_size, progs.stop_len(), jax.random.key(0)
  )
  tok, mask, pos = chunk([[4, 5]], [0], 8, 0)
  state = progs.prefill_insert(params, state, np.array([2]), np.array([True]), tok, mask, pos,
                               np.array([3]))  # fmt: skip
  before = jax.device_get(state.cache)
  state, out = progs.generate(params, state)
  after = jax.device_get(state.cache)
  assert np.asarray(out.valid_BxN)[2].all() and not np.asarray(out.valid_BxN)[:2].any()
  np.testing.assert_array_equal(after.k[:, :2], before.k[:, :2])
  assert list(after.end_B) == [0, 0, 5] and not jnp.any(state.live_B)
