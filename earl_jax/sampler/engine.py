"""The rollout engine: prefill a chunk of new tokens into the KV cache, then decode in one jit loop.

Data flow: the multi-turn rollout (``rl/rollout.py``) calls ``generate`` once per turn. The chunk it
passes is the new context of each row (the first prompt, or the environment's answer appended to a
row that already has a cache): it is written into the cache after whatever the row already holds,
and decoding continues from there. Tokens, their log-probs and masks come back as device arrays;
only the loop's small host metadata (lengths, stop flags) is read on the host.

The whole decode runs inside one ``lax.while_loop`` (no per-token host round trip). The cache is
donated: at long context it is the largest buffer of the rollout stage, and without donation XLA
would keep the input and the output cache alive at once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from earl_jax.sampler import sampling
from earl_jax.types import ConfigError


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
  """Static description of one generate call (hashable: a jit static argument)."""

  strategy: sampling.Strategy = dataclasses.field(default_factory=sampling.Greedy)
  max_new_tokens: int = 32
  stop_sequences: tuple[tuple[int, ...], ...] = ()  # a row stops after emitting any of these
  pad_id: int = 0

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ConfigError("max_new_tokens", self.max_new_tokens, "an int >= 1")
    for seq in self.stop_sequences:
      if not seq or any(t < 0 for t in seq):
        raise ConfigError("stop_sequences", self.stop_sequences, "non-empty tuples of token ids")

  @classmethod
  def with_stop_ids(cls, stop_ids: tuple[int, ...], **kwargs) -> GenerationSpec:
    """Single-token stops (eos, <|im_end|>, ...) plus any stop sequences given in kwargs."""
    seqs = tuple((t,) for t in stop_ids) + tuple(kwargs.pop("stop_sequences", ()))
    return cls(stop_sequences=seqs, **kwargs)


@flax.struct.dataclass
class GenerateOutput:
  """What one generate call produced, per row. N = spec.max_new_tokens.

  tokens_BxN: sampled ids, ``pad_id`` after the row stopped; the stop token itself is included.
  logps_BxN: log-prob of each sampled token under the sampling distribution; 0 where masked.
  mask_BxN: True on tokens the policy produced.
  lengths_B: number of produced tokens.
  stopped_B: the row emitted a stop sequence (False: it ran out of max_new_tokens or was inactive).
  next_positions_B: RoPE position of the next token appended to the row (for continuation).
  """

  tokens_BxN: jax.Array
  logps_BxN: jax.Array
  mask_BxN: jax.Array
  lengths_B: jax.Array
  stopped_B: jax.Array
  next_positions_B: jax.Array


def stop_table(spec: GenerationSpec) -> tuple[jax.Array, int]:
  """Stop sequences right-aligned in a [num_stops, M] table, -1 = wildcard padding on the left."""
  m = max((len(s) for s in spec.stop_sequences), default=1)
  rows = [(-1,) * (m - len(s)) + tuple(s) for s in spec.stop_sequences]
  return jnp.asarray(rows, jnp.int32).reshape(len(rows), m), m


def _last_valid_index(mask_BxT: jax.Array) -> jax.Array:
  t_BxT = jnp.broadcast_to(jnp.arange(mask_BxT.shape[1], dtype=jnp.int32), mask_BxT.shape)
  return jnp.max(jnp.where(mask_BxT, t_BxT, -1), axis=1)


def generate(
  model: nnx.Module,
  cache,
  prompt_BxP: jax.Array,
  prompt_mask_BxP: jax.Array,
  prompt_positions_BxP: jax.Array,
  active_B: jax.Array,
  rng: jax.Array,
  answer_bits_B: jax.Array | None = None,
  *,
  spec: GenerationSpec,
):
  """Appends the prompt chunk to each row's cache and decodes up to ``spec.max_new_tokens``.

  Args:
    model: the policy ``earl_jax.model.Decoder`` (call inside jit; see ``make_generate_fn``).
    cache: a ``KVCache`` with room for P + max_new_tokens more slots in every row.
    prompt_BxP: the new tokens of each row (padding anywhere, marked by the mask).
    prompt_mask_BxP: True on real tokens. An active row needs at least one.
    prompt_positions_BxP: RoPE positions of the new tokens (continue the row's previous positions).
    active_B: rows to decode; inactive rows only get their (masked) chunk written.
    rng: PRNG key.
    answer_bits_B: int32 per-row answer masks, exactly when the strategy is per-row
      (``sampling.needs_answer_bits``): which of its answers each row may decode this turn.
    spec: static generation settings.

  Returns:
    (GenerateOutput, cache) with the generated tokens already written into the cache, so the next
    turn only prefills the environment's answer.
  """
  b, n = prompt_BxP.shape[0], spec.max_new_tokens
  if sampling.needs_answer_bits(spec.strategy) != (answer_bits_B is not None):
    raise ValueError(
      f"strategy {spec.strategy} called with answer_bits_B={answer_bits_B}: per-row answer "
      "masks go with exactly the per-row Restricted strategy"
    )
  logits_BxV, pos_B, active_B, cache = prefill_chunk(
    model, cache, prompt_BxP, prompt_mask_BxP, prompt_positions_BxP, active_B
  )
  stops_SxM, m = stop_table(spec)
  init = _Decode(
    i=jnp.int32(0),
    done_B=~active_B,
    stopped_B=jnp.zeros((b,), jnp.bool_),
    logits_BxV=logits_BxV,
    pos_B=pos_B,
    hist_BxM=jnp.full((b, m), -2, jnp.int32),
    tokens_BxN=jnp.full((b, n), spec.pad_id, jnp.int32),
    logps_BxN=jnp.zeros((b, n), jnp.float32),
    mask_BxN=jnp.zeros((b, n), jnp.bool_),
    cache=cache,
    rng=rng,
  )
  sample = spec.strategy.sample
  if answer_bits_B is not None:
    sample = functools.partial(sample, answer_bits_B=answer_bits_B)
  step = functools.partial(_decode_step, model, spec, sample, stops_SxM, decode_layers(model))
  end = jax.lax.while_loop(lambda c: (c.i < n) & ~jnp.all(c.done_B), step, init)
  result = GenerateOutput(
    tokens_BxN=end.tokens_BxN,
    logps_BxN=end.logps_BxN,
    mask_BxN=end.mask_BxN,
    lengths_B=jnp.sum(end.mask_BxN, axis=1, dtype=jnp.int32),
    stopped_B=end.stopped_B,
    next_positions_B=end.pos_B,
  )
  return result, end.cache


class _Decode(NamedTuple):
  """The decode loop's carry."""

  i: jax.Array  # tokens decoded so far
  done_B: jax.Array  # rows that stopped, ran out or were never active
  stopped_B: jax.Array  # rows that hit a stop sequence
  logits_BxV: jax.Array  # next-token logits
  pos_B: jax.Array  # position of the next token
  hist_BxM: jax.Array  # the last M tokens, for stop-sequence matching
  tokens_BxN: jax.Array
  logps_BxN: jax.Array
  mask_BxN: jax.Array
  cache: Any
  rng: jax.Array


def prefill_chunk(model, cache, prompt_BxP, prompt_mask_BxP, prompt_positions_BxP, active_B):
  """Writes the prompt chunk into the cache; the logits after each row's last real token."""
  h_BxPxD, cache = model.hidden(
    prompt_BxP, prompt_positions_BxP, mask_BxT=prompt_mask_BxP, cache=cache
  )
  last_B = _last_valid_index(prompt_mask_BxP)
  active_B = active_B & (last_B >= 0)
  h_Bx1xD = jnp.take_along_axis(h_BxPxD, jnp.maximum(last_B, 0)[:, None, None], axis=1)
  logits_BxV = model.project(h_Bx1xD)[:, 0].astype(jnp.float32)
  pos_B = jnp.max(jnp.where(prompt_mask_BxP, prompt_positions_BxP, -1), axis=1) + 1
  return logits_BxV, pos_B, active_B, cache


def decode_layers(model) -> list | None:
  """Per-layer weights for the decode loop, sliced here once (``ModelConfig.decode_layers``);
  None: the loop scans the stacked blocks."""
  return model.layer_states() if model.cfg.unrolled_decode(jax.default_backend()) else None


def _decode_step(model, spec: GenerationSpec, sample, stops_SxM: jax.Array, layers, c: _Decode):
  """Samples one token per live row, records it, and feeds it through the model."""
  rng, key = jax.random.split(c.rng)
  tok_B, logp_B = sample(c.logits_BxV, key)
  live_B = ~c.done_B
  tok_B = jnp.where(live_B, tok_B, spec.pad_id)
  hist_BxM = jnp.concatenate([c.hist_BxM[:, 1:], tok_B[:, None]], axis=1)
  match_BxS = jnp.all((hist_BxM[:, None, :] == stops_SxM[None]) | (stops_SxM[None] < 0), axis=-1)
  hit_B = live_B & jnp.any(match_BxS, axis=-1)  # False when there are no stop sequences
  # Feed the token just sampled (the stop token too) so the cache holds the whole turn.
  h_Bx1xD, cache = model.hidden(
    tok_B[:, None], c.pos_B[:, None], mask_BxT=live_B[:, None], cache=c.cache, layers=layers
  )
  return _Decode(
    i=c.i + 1,
    done_B=c.done_B | hit_B,
    stopped_B=c.stopped_B | hit_B,
    logits_BxV=model.project(h_Bx1xD)[:, 0].astype(jnp.float32),
    pos_B=c.pos_B + live_B.astype(jnp.int32),
    hist_BxM=hist_BxM,
    tokens_BxN=c.tokens_BxN.at[:, c.i].set(tok_B),
    logps_BxN=c.logps_BxN.at[:, c.i].set(jnp.where(live_B, logp_B, 0.0)),
    mask_BxN=c.mask_BxN.at[:, c.i].set(live_B),
    cache=cache,
    rng=rng,
  )


def generate_split(graphdef: nnx.GraphDef, state: nnx.State, cache, *args, spec: GenerationSpec):
  """``generate`` on a split model: the form the executable cache jits with explicit shardings."""
  return generate(nnx.merge(graphdef, state), cache, *args, spec=spec)


def make_generate_fn(graphdef: nnx.GraphDef, spec: GenerationSpec):
  """A jitted ``(state, cache, prompt, mask, positions, active, rng) -> (GenerateOutput, cache)``.

  The cache (argument 1) is donated. Layout-aware callers use ``parallel/executables.py``, which
  jits the same function with the shardings of a StagePlan.
  """
  fn = functools.partial(generate_split, graphdef, spec=spec)
  return jax.jit(fn, donate_argnums=(1,))
