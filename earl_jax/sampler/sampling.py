"""Sampling strategies of the rollout engine: frozen dataclasses with one method each.

The decode loop (``sampler/engine.py``) calls ``strategy.sample(logits_BxV, rng)`` once per step.
Strategies are hashable so they can be static arguments of the jitted loop.

The returned log-prob is that of the sampled token under the distribution actually sampled from
(temperature applied, top-k / top-p truncated and renormalised): the behaviour policy of the
importance ratios in PPO-style losses. ``Greedy`` samples from a point mass, whose log-prob (0) is
useless for RL, so it reports the log-prob under the unmodified model distribution instead.
``Restricted`` wraps any of them to decode among a fixed set of token ids only (an environment's
single-token answers), optionally narrowed per row to the answers legal in each row's position
(``answer_bits_B``: bit j set = ``allowed[j]`` may be played); its log-probs are those of the
restricted distribution, which the loss scores with the same ``restrict`` (``rl/reference.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from earl_jax.types import ConfigError

_NEG = -1e30  # logit of an excluded token: exp() is exactly 0 in f32 and no inf arithmetic


def _log_softmax_pick(logits_BxV: jax.Array, tokens_B: jax.Array) -> jax.Array:
  logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  return jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Argmax decoding (evaluation, tests)."""

  def sample(self, logits_BxV: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    del rng
    logits_BxV = logits_BxV.astype(jnp.float32)
    tokens_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return tokens_B, _log_softmax_pick(logits_BxV, tokens_B)


@dataclasses.dataclass(frozen=True)
class Temperature:
  """Ancestral sampling from softmax(logits / temperature)."""

  temperature: float = 1.0

  def __post_init__(self):
    if not self.temperature > 0:
      raise ConfigError("temperature", self.temperature, "a positive float (use Greedy for 0)")

  def process(self, logits_BxV: jax.Array) -> jax.Array:
    return logits_BxV.astype(jnp.float32) / self.temperature

  def sample(self, logits_BxV: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _sample_processed(self.process(logits_BxV), rng)


@dataclasses.dataclass(frozen=True)
class TopK:
  """Sample among the k most likely tokens, after temperature."""

  k: int = 50
  temperature: float = 1.0

  def __post_init__(self):
    if self.k < 1:
      raise ConfigError("k", self.k, "an int >= 1")
    Temperature(self.temperature)  # validates

  def process(self, logits_BxV: jax.Array) -> jax.Array:
    logits_BxV = logits_BxV.astype(jnp.float32) / self.temperature
    k = min(self.k, logits_BxV.shape[-1])
    kth_B1 = jax.lax.top_k(logits_BxV, k)[0][:, k - 1 :]
    # Ties at the k-th value are all kept: the set stays a deterministic function of the logits.
    return jnp.where(logits_BxV >= kth_B1, logits_BxV, _NEG)

  def sample(self, logits_BxV: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _sample_processed(self.process(logits_BxV), rng)


@dataclasses.dataclass(frozen=True)
class TopP:
  """Nucleus sampling: the smallest set of tokens whose probability reaches p, after temperature."""

  p: float = 0.95
  temperature: float = 1.0

  def __post_init__(self):
    if not 0.0 < self.p <= 1.0:
      raise ConfigError("p", self.p, "a float in (0, 1]")
    Temperature(self.temperature)

  def process(self, logits_BxV: jax.Array) -> jax.Array:
    logits_BxV = logits_BxV.astype(jnp.float32) / self.temperature
    probs_BxV = jax.nn.softmax(logits_BxV, axis=-1)
    sorted_BxV = jnp.sort(probs_BxV, axis=-1)[:, ::-1]
    # A token is kept when the mass strictly before it (in descending order) is below p, so the
    # most likely token is always kept.
    before_BxV = jnp.cumsum(sorted_BxV, axis=-1) - sorted_BxV
    keep_BxV = before_BxV < self.p
    threshold_B1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(probs_BxV >= threshold_B1, logits_BxV, _NEG)

  def sample(self, logits_BxV: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _sample_processed(self.process(logits_BxV), rng)


ALL_ANSWERS = -1  # an answer-bits value with every bit set: the whole alphabet is allowed
MAX_ANSWERS = 31  # answers a per-row bitmask (int32, sign bit unused) can address


def restrict(
  logits_xV: jax.Array, allowed: tuple[int, ...], answer_bits_x: jax.Array | None = None
) -> jax.Array:
  """``logits_xV`` in float32 with every token outside ``allowed`` excluded (logit -1e30, so its
  probability is exactly 0 and it gets no gradient). ``allowed`` is static. ``answer_bits_x``
  (int32, the leading dims of ``logits_xV``) narrows each distribution further: bit j clear
  excludes ``allowed[j]``; a value with no bit of the alphabet set keeps the whole alphabet (a
  row with no legal answer never decodes anything real, and must not become a uniform draw over
  the vocabulary)."""
  v = logits_xV.shape[-1]
  if not allowed or min(allowed) < 0 or max(allowed) >= v:
    raise ValueError(f"allowed token ids {allowed} must be a non-empty subset of [0, {v})")
  ids_A = jnp.asarray(allowed, jnp.int32)
  if answer_bits_x is None:
    keep_xV = jnp.zeros((v,), jnp.bool_).at[ids_A].set(True)
  else:
    if len(allowed) > MAX_ANSWERS:
      raise ValueError(f"{len(allowed)} answers; a per-row answer mask holds <= {MAX_ANSWERS}")
    bits_x = answer_bits_x.astype(jnp.int32) & ((1 << len(allowed)) - 1)
    bits_x = jnp.where(bits_x == 0, ALL_ANSWERS, bits_x)
    shifts_xA = jnp.arange(len(allowed), dtype=jnp.int32).reshape((1,) * bits_x.ndim + (-1,))
    keep_xA = (bits_x[..., None] >> shifts_xA) & 1 == 1
    keep_xV = jnp.zeros(logits_xV.shape, jnp.bool_).at[..., ids_A].set(keep_xA)
  return jnp.where(keep_xV, logits_xV.astype(jnp.float32), _NEG)


@dataclasses.dataclass(frozen=True)
class Restricted:
  """``inner`` applied to the logits of the ``allowed`` token ids only: every decoded token is
  one of them (a game's moves when each move is one token). With ``per_row``, ``sample`` also
  takes each row's answer bits (``restrict``): only the moves legal in that row's position.
  The reported log-prob is under the restricted distribution (for ``Greedy`` too), the one
  ``rl/reference.token_logps(allowed=..., answer_bits_BxT=...)`` scores, so the PPO ratio
  compares like with like."""

  inner: Greedy | Temperature | TopK | TopP
  allowed: tuple[int, ...]
  per_row: bool = False

  def __post_init__(self):
    ids = self.allowed
    if not ids or any(not isinstance(i, int) or i < 0 for i in ids) or len(set(ids)) != len(ids):
      raise ConfigError("allowed", ids, "a non-empty tuple of distinct non-negative token ids")
    if self.per_row and len(ids) > MAX_ANSWERS:
      raise ConfigError("allowed", ids, f"at most {MAX_ANSWERS} ids with per-row answer masks")

  def sample(
    self, logits_BxV: jax.Array, rng: jax.Array, answer_bits_B: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array]:
    if self.per_row != (answer_bits_B is not None):
      raise ValueError(
        f"Restricted(per_row={self.per_row}) sampled with answer_bits_B={answer_bits_B}"
      )
    return self.inner.sample(restrict(logits_BxV, self.allowed, answer_bits_B), rng)


def needs_answer_bits(strategy: object) -> bool:
  """Whether ``strategy.sample`` takes per-row answer bits (the decode program's extra input)."""
  return isinstance(strategy, Restricted) and strategy.per_row


def _sample_processed(logits_BxV: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
  tokens_B = jax.random.categorical(rng, logits_BxV, axis=-1).astype(jnp.int32)
  return tokens_B, _log_softmax_pick(logits_BxV, tokens_B)


Strategy = Greedy | Temperature | TopK | TopP | Restricted


def make_strategy(
  name: str,
  *,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  allowed: tuple[int, ...] = (),
  per_row: bool = False,
) -> Strategy:
  """Builds a strategy from config values: greedy | temperature | top_k | top_p, restricted to
  the ``allowed`` token ids when given (and to each row's legal ones with ``per_row``)."""
  if name == "greedy":
    strategy = Greedy()
  elif name == "temperature":
    strategy = Temperature(temperature)
  elif name == "top_k":
    strategy = TopK(top_k, temperature)
  elif name == "top_p":
    strategy = TopP(top_p, temperature)
  else:
    raise ConfigError("strategy", name, "one of ['greedy', 'temperature', 'top_k', 'top_p']")
  if per_row and not allowed:
    raise ConfigError("per_row", per_row, "False without allowed token ids")
  return Restricted(strategy, tuple(allowed), per_row) if allowed else strategy
