"""Compiled stage programs, one per (stage, plan, shape bucket), with memory and cost analyses.

Data flow: the loop asks the selector for a StagePlan, then asks this cache for the program of that
plan and the current length bucket. Each program is the stage's pure function jitted with the
plan's explicit in/out shardings and donation, lowered from abstract shapes (nothing allocated)
and compiled ahead of time, so ``memory_analysis()`` is known before the program ever runs: the
selector checks that a plan fits before first use. A repeated key reuses the compiled program.

Memory figures are per device. On CPU ``peak_memory_in_bytes`` leaves out temporaries
(env_probe.md section 2), so the peak used here is argument + output + temp - alias everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax import model as model_lib
from earl_jax.model import layout as model_layout
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel.plan import StagePlan
from earl_jax.sampler import engine, sampling
from earl_jax.types import Stage


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """Per-device bytes of a compiled program."""

  argument: int
  output: int
  temp: int
  alias: int

  @property
  def peak(self) -> int:
    return self.argument + self.output + self.temp - self.alias

  @classmethod
  def of(cls, compiled: jax.stages.Compiled) -> MemoryStats:
    m = compiled.memory_analysis()
    return cls(
      int(m.argument_size_in_bytes),
      int(m.output_size_in_bytes),
      int(m.temp_size_in_bytes),
      int(m.alias_size_in_bytes),
    )


@dataclasses.dataclass(frozen=True)
class StageProgram:
  """A compiled stage program and what the selector needs to know about it."""

  stage: Stage
  plan: StagePlan
  bucket: tuple[int, ...]
  compiled: jax.stages.Compiled
  memory: MemoryStats
  flops: float  # per device, from cost_analysis
  bytes_accessed: float  # per device
  compile_seconds: float

  def __call__(self, *args: Any) -> Any:
    return self.compiled(*args)


def _cost(compiled: jax.stages.Compiled) -> tuple[float, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax returned one dict per computation
    cost = cost[0] if cost else {}
  cost = cost or {}
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


class ExecutableCache:
  """Programs keyed by (stage, plan, bucket, extra); ``compilations`` counts real compiles."""

  def __init__(self) -> None:
    self._programs: dict[Hashable, StageProgram] = {}
    self.compilations = 0
    self.compile_seconds: dict[str, float] = {}  # per stage: lowering + compiling, all programs

  def get(
    self,
    stage: Stage,
    plan: StagePlan,
    bucket: tuple[int, ...],
    lower: Callable[[], jax.stages.Lowered],
    extra: Hashable = (),
  ) -> StageProgram:
    key = (stage, plan, bucket, extra)
    program = self._programs.get(key)
    if program is None:
      start = time.perf_counter()
      compiled = lower().compile()
      seconds = time.perf_counter() - start
      flops, nbytes = _cost(compiled)
      program = StageProgram(
        stage, plan, bucket, compiled, MemoryStats.of(compiled), flops, nbytes, seconds
      )
      self._programs[key] = program
      self.compilations += 1
      name = getattr(stage, "value", str(stage))
      self.compile_seconds[name] = self.compile_seconds.get(name, 0.0) + seconds
    return program

  def __len__(self) -> int:
    return len(self._programs)


@contextlib.contextmanager
def activation_layout(plan: StagePlan) -> Iterator[None]:
  """Traces inside constrain the model's activations to ``plan``'s logical->mesh rules."""
  resolver = functools.partial(_activation_sharding, plan=plan)
  with model_layout.activation_layout(resolver):
    yield


def _activation_sharding(logical_axes, shape, *, plan: StagePlan) -> NamedSharding:
  return mesh_lib.logical_to_sharding(logical_axes, shape, plan)


def _sds(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
  # Not jnp.dtype(dtype): it rejects extended dtypes such as PRNG keys (key<fry>).
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: _sds(x.shape, x.dtype, s), tree, shardings)


def replicated(plan: StagePlan) -> NamedSharding:
  return NamedSharding(mesh_lib.build_mesh(plan), P())


def cache_shardings(plan: StagePlan, cache: model_lib.KVCache) -> model_lib.KVCache:
  """Shardings of a KV cache under ``plan`` (from the cache's logical axes; fails closed)."""
  specs = model_lib.cache_partition_specs()
  return jax.tree.map(
    lambda spec, x: mesh_lib.logical_to_sharding(tuple(spec), x.shape, plan),
    specs,
    cache,
    is_leaf=lambda x: isinstance(x, P),
  )


def lower_generate(
  plan: StagePlan,
  graphdef: nnx.GraphDef,
  abstract_state: nnx.State,
  cache_len: int,
  spec: engine.GenerationSpec,
  bucket: tuple[int, int],
) -> jax.stages.Lowered:
  """The rollout program for ``bucket`` = (slots B, prompt chunk P); the cache is donated. A
  per-row answer restriction (``sampling.needs_answer_bits``) adds the [B] answer bits last."""
  b, p = bucket
  cfg = graphdef_config(graphdef, abstract_state)
  cache = jax.eval_shape(lambda: model_lib.init_cache(cfg, b, cache_len))
  state_sh = mesh_lib.state_shardings(abstract_state, plan)
  cache_sh = cache_shardings(plan, cache)
  row2, row1 = mesh_lib.batch_sharding(plan, 2), mesh_lib.batch_sharding(plan, 1)
  rep = replicated(plan)
  args = (
    _abstract(abstract_state, state_sh),
    _abstract(cache, cache_sh),
    _sds((b, p), jnp.int32, row2),
    _sds((b, p), jnp.bool_, row2),
    _sds((b, p), jnp.int32, row2),
    _sds((b,), jnp.bool_, row1),
    jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep),
  )
  in_sh = (state_sh, cache_sh, row2, row2, row2, row1, rep)
  if sampling.needs_answer_bits(spec.strategy):
    args += (_sds((b,), jnp.int32, row1),)
    in_sh += (row1,)
  out_sh = engine.GenerateOutput(row2, row2, row2, row1, row1, row1)
  fn = functools.partial(engine.generate_split, graphdef, spec=spec)
  jitted = jax.jit(
    fn,
    in_shardings=in_sh,
    out_shardings=(out_sh, cache_sh),
    donate_argnums=(1,),
  )
  with activation_layout(plan):
    return jitted.lower(*args)


def graphdef_config(graphdef: nnx.GraphDef, abstract_state: nnx.State) -> Any:
  """The ModelConfig a Decoder graph was built with."""
  return nnx.merge(graphdef, abstract_state).cfg


def lower_score(
  plan: StagePlan,
  graphdef: nnx.GraphDef,
  abstract_state: nnx.State,
  bucket: tuple[int, int],
  score_fn: Callable[..., jax.Array],
  row_dtypes: tuple[Any, ...] = (jnp.int32, jnp.int32, jnp.bool_),
) -> jax.stages.Lowered:
  """A scoring program for ``bucket`` = (B, T): ``score_fn(model, *rows)`` returns [B, T] (the
  reference stage's log-probs, from ``earl_jax.rl.programs``); the rows are [B, T] arrays of
  ``row_dtypes`` (tokens, positions, valid, then whatever else the score reads)."""
  b, t = bucket
  state_sh = mesh_lib.state_shardings(abstract_state, plan)
  row2 = mesh_lib.batch_sharding(plan, 2)

  def fn(state, *rows):
    return score_fn(nnx.merge(graphdef, state), *rows)

  in_sh = (state_sh,) + (row2,) * len(row_dtypes)
  jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=row2)
  rows = [_sds((b, t), dtype, row2) for dtype in row_dtypes]
  args = (_abstract(abstract_state, state_sh), *rows)
  with activation_layout(plan):
    return jitted.lower(*args)


def lower_train_step(
  plan: StagePlan,
  abstract_train_state: Any,
  abstract_batch: Any,
  step_fn: Callable[[Any, Any], tuple[Any, Any]],
  optimizer: optax.GradientTransformation,
) -> jax.stages.Lowered:
  """A training program: ``step_fn(state, batch) -> (state, metrics)`` with the state in
  ``train_state_shardings`` (donated), the batch's [B, ...] leaves on the batch axes and the
  metrics replicated (the update stage's, from ``earl_jax.rl.programs``)."""
  state_sh = train_state_shardings(plan, abstract_train_state, optimizer)
  batch_sh = jax.tree.map(lambda x: mesh_lib.batch_sharding(plan, len(x.shape)), abstract_batch)
  jitted = jax.jit(
    step_fn,
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, replicated(plan)),
    donate_argnums=(0,),
  )
  with activation_layout(plan):
    return jitted.lower(
      _abstract(abstract_train_state, state_sh), _abstract(abstract_batch, batch_sh)
    )


def train_state_shardings(
  plan: StagePlan, abstract_train_state: Any, optimizer: optax.GradientTransformation
) -> Any:
  """Shardings of a train state (a pytree dataclass with ``params`` and ``opt_state``): params,
  and the optimiser leaves shaped like params (Adam moments), share their layout; everything
  else (step counters, keys) is replicated."""
  params_sh = mesh_lib.state_shardings(abstract_train_state.params, plan)
  rep = replicated(plan)
  opt_sh = optax.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    abstract_train_state.opt_state,
    params_sh,
    transform_non_params=lambda _: rep,
  )
  everything_replicated = jax.tree.map(lambda _: rep, abstract_train_state)
  return everything_replicated.replace(params=params_sh, opt_state=opt_sh)
