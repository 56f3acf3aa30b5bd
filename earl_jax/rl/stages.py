"""Stage resources: what each stage runs on, apart from the RL algorithm that uses it.

``StageResources`` owns, for the three stages (rollout, reference, update): the one copy of their
plans, the compiled programs (one lowering per stage, cached per plan and shape), the weights in
each stage's layout (the policy's train state on the update layout, the frozen reference on the
reference layout), the rollout KV cache, the parallelism selector and the re-layout that follows
its decisions. The learner (``rl/loop.py``) calls one method per stage and never sees a sharding:

  rollout_weights()  policy weights -> the rollout layout (the weight sync)
  rollout(...)       multi-turn episodes with those weights -> RolloutResult (host batch)
  score(batch)       the batch on the reference layout with old/reference log-probs -> ScoredBatch
  to_update(batch)   a reference-layout batch -> the update layout (the dispatcher)
  update(batch)      one optimiser step on the train state -> its metrics (device arrays)
  choose(...)        asks the selector for a stage's plan and moves that stage's state there

Every stage method returns arrays (or host data the env loop needs), never a program; memory checks
ask ``compiled(stage, plan, batch)``. Nothing blocks on the device except the rollout, whose env
loop needs each turn's tokens on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from earl_jax import config_lib
from earl_jax import model as model_lib
from earl_jax.model import hf_import
from earl_jax.parallel import dispatcher, executables
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel import selector as selector_lib
from earl_jax.parallel.plan import ParallelPlan, StagePlan
from earl_jax.rl import batches, preflight, programs, rollout, update
from earl_jax.sampler import engine
from earl_jax.sampler import slots as slots_lib
from earl_jax.types import Stage


def put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """Host (or process-local) data -> an array in ``sharding``, on one or several processes.

  With several processes every process holds the same host value (the env loop is replicated)
  and contributes only its own devices' blocks.
  """
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = np.asarray(jax.random.key_data(x))
    raw = jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx])
    return jax.random.wrap_key_data(raw, impl=jax.random.key_impl(x))
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def fetch(tree: Any) -> Any:
  """Device arrays -> host numpy on every process (small rollout outputs the env loop needs)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def batch_shardings(plan: StagePlan, batch: Any) -> Any:
  return jax.tree.map(lambda x: mesh_lib.batch_sharding(plan, np.ndim(x)), batch)


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> Any:
  return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _resizer(length: int, shardings: Any) -> Any:
  return jax.jit(functools.partial(model_lib.resize_cache, max_len=length), out_shardings=shardings)


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def selector_load(cfg: config_lib.ExperimentConfig, stage: Stage) -> int:
  """Sequences ``stage`` handles at once, the load its plans are chosen for: the rollout's slots,
  the reference's batch, the update's mini-batch (one optimiser step; its plan's micro-batches
  split that)."""
  if stage is Stage.ROLLOUT:
    return cfg.rollout.num_slots
  return cfg.rl.batch_size // (cfg.rl.mini_batches if stage is Stage.UPDATE else 1)


def rollout_slots(cfg: config_lib.ExperimentConfig, plan: StagePlan) -> int:
  """Episodes the rollout decodes at once on ``plan``: its micro-batch (the selector's waves:
  fewer cache rows, refilled as episodes end) or every slot."""
  return plan.micro_batch_size or cfg.rollout.num_slots


def cache_length(rc: rollout.RolloutConfig, needed: int) -> int:
  """KV-cache slots per row for a context of ``needed`` tokens: its geometric length bucket (the
  one the selector plans with), at most ``rc.cache_len()``."""
  return min(selector_lib.bucket_for(max(needed, 1), rc.seq_multiple), rc.cache_len())


class StageResources:
  """Plans, programs, weights, KV cache and selector of one run's three stages."""

  def __init__(self, cfg: config_lib.ExperimentConfig, setup: preflight.RunSetup, workdir):
    self.cfg, self.model_cfg, self.devices = cfg, setup.model_cfg, setup.devices
    self.tokenizer = setup.tokenizer
    self.answer_ids = setup.answer_ids  # () unless sampler.restrict_answers
    self.plans: ParallelPlan = setup.plans  # the only copy; ``choose`` replaces it
    self.optimizer = update.make_optimizer(cfg.optim)
    self._init_weights(setup.pretrained_dir)
    self._cache_need = cfg.rollout.seq_multiple  # slots the last training rollout's rows needed
    self.kv_cache = self._new_kv_cache(self._cache_need)
    self._slot_cache: dict[engine.GenerationSpec, slots_lib.SlotPrograms] = {}
    self.selector = None
    if cfg.parallel.selector:
      budget = int(cfg.parallel.memory_budget_gib * 2**30) or None  # None: device.memory_stats()
      self.selector = selector_lib.Selector(
        self.model_cfg,
        self.devices,
        memory_budget_bytes=budget,
        profile_path=str(pathlib.Path(workdir) / "selector_profile.json"),
        prompt_chunk=cfg.rollout.chunk_multiple,
        new_tokens=cfg.rollout.max_new_tokens,
        logits_chunk=cfg.rl.logp_chunk,
      )

  def _init_weights(self, pretrained_dir: pathlib.Path | None) -> None:
    """The policy (train state, update layout) and the frozen reference (reference layout)."""
    cfg, plan = self.cfg, self.plans[Stage.UPDATE]
    if pretrained_dir is not None:
      # Each device reads only its block of the checkpoint, straight into the update layout.
      abstract = nnx.eval_shape(lambda: model_lib.Decoder(self.model_cfg, rngs=nnx.Rngs(0)))
      shardings = mesh_lib.state_shardings(nnx.state(abstract), plan)
      model = hf_import.load_weights(str(pretrained_dir), self.model_cfg, shardings)
    else:
      init = lambda: model_lib.Decoder(self.model_cfg, rngs=nnx.Rngs(cfg.seed))  # noqa: E731
      model = mesh_lib.create_sharded(init, plan)
    self.graphdef, params = nnx.split(model)
    self.abstract_params = _abstract(params)
    state = update.init_train_state(params, self.optimizer, jax.random.key(cfg.seed))
    shardings = executables.train_state_shardings(plan, state, self.optimizer)
    self.state = jax.tree.map(put, state, shardings)
    self.abstract_state = _abstract(self.state)
    self.programs = programs.StagePrograms(
      cfg,
      self.graphdef,
      self.abstract_params,
      self.abstract_state,
      self.optimizer,
      answer_ids=self.answer_ids,
    )
    # The frozen reference must own its buffers: with equal layouts the sync is a no-op that
    # would alias the policy's parameters, which the update step donates.
    ref_params, _ = dispatcher.sync_weights(params, self.plans[Stage.REFERENCE])
    self.ref_params = jax.tree.map(jnp.copy, ref_params)

  def _cache_length(self, needed: int) -> int:
    return cache_length(self.cfg.rollout, needed)

  def _slots(self, plan: StagePlan) -> int:
    return rollout_slots(self.cfg, plan)

  def _new_kv_cache(self, needed: int = 0) -> model_lib.KVCache:
    length, rows = self._cache_length(needed), self._slots(self.plans[Stage.ROLLOUT])
    init = lambda: model_lib.init_cache(self.model_cfg, rows, length)  # noqa: E731
    shardings = executables.cache_shardings(self.plans[Stage.ROLLOUT], jax.eval_shape(init))
    return jax.jit(init, out_shardings=shardings)()

  def _resize_kv_cache(self, cache: model_lib.KVCache, needed: int) -> model_lib.KVCache:
    """``cache`` re-allocated to the bucket of ``needed`` slots, on device, contents kept."""
    length = self._cache_length(needed)
    if length == cache.max_len:
      return cache
    resized = jax.eval_shape(functools.partial(model_lib.resize_cache, max_len=length), cache)
    return _resizer(length, executables.cache_shardings(self.plans[Stage.ROLLOUT], resized))(cache)

  # --- checkpointed state -------------------------------------------------------------------

  def checkpoint_state(self) -> dict[str, Any]:
    return {"train": self.state, "reference": self.ref_params}

  def load_checkpoint_state(self, restored: dict[str, Any]) -> None:
    self.state, self.ref_params = restored["train"], restored["reference"]

  # --- programs: one lowering per stage -----------------------------------------------------

  def spec(self, *, evaluation: bool = False) -> engine.GenerationSpec:
    return engine.GenerationSpec.with_stop_ids(
      tuple(self.tokenizer.stop_ids),
      strategy=self.cfg.sampler.make(evaluation=evaluation, answer_ids=self.answer_ids),
      max_new_tokens=self.cfg.rollout.max_new_tokens,
      pad_id=self.tokenizer.pad_id,
    )

  def compiled(
    self, stage: Stage, plan: StagePlan, batch: batches.RolloutBatch | None, length: int = 0
  ):
    """``stage``'s compiled program on ``plan`` (for memory checks; the stage methods run it);
    the rollout's with a cache for a context of ``length`` tokens."""
    if stage is Stage.ROLLOUT:
      bucket = (self._slots(plan), self.cfg.rollout.chunk_multiple)
      return self.programs.rollout(plan, self.spec(), bucket, self._cache_length(length))
    if stage is Stage.REFERENCE:
      return self.programs.score(plan, batch.tokens_BxT.shape)
    return self.programs.update(plan, programs.abstract_update_batch(*batch.tokens_BxT.shape))

  # --- the stages ---------------------------------------------------------------------------

  def rollout_weights(self) -> tuple[nnx.State, dispatcher.DispatchStats]:
    """The weight sync: the policy's parameters on the rollout layout."""
    return dispatcher.sync_weights(self.state.params, self.plans[Stage.ROLLOUT], account=True)

  def rollout(
    self,
    params: nnx.State,
    episodes: list[rollout.EpisodeSpec],
    envs: list[Any],
    fmt: Any,
    rng: jax.Array,
    *,
    evaluation: bool = False,
    expert_answers: bool = False,
  ) -> rollout.RolloutResult:
    """Plays ``episodes`` on ``envs`` with ``params`` (from ``rollout_weights``); with
    ``expert_answers``, the batch records the envs' expert labels (the imitation term's)."""
    spec = self.spec(evaluation=evaluation)
    slots = self._slots(self.plans[Stage.ROLLOUT])
    # The cache starts at the bucket the last training rollout filled and grows when episodes
    # need more: decode attends over the context the episodes have, not the whole budget.
    cache = self._resize_kv_cache(self.kv_cache, self._cache_need)
    rc = dataclasses.replace(self.cfg.rollout, num_slots=slots)
    common = dict(pad_id=self.tokenizer.pad_id, resize=self._resize_kv_cache)
    if expert_answers and rc.batching != "turn":
      raise ValueError("expert labels are recorded turn by turn: rollout.batching must be 'turn'")
    if rc.batching == "continuous":
      slot_programs = self._slot_programs(spec)
      state = slot_programs.new_state(cache, self.model_cfg.padded_vocab_size, rng)
      result, state = rollout.run_rollout_continuous(
        slot_programs.bind(params), state, envs[:slots], fmt, episodes, rc, rng, **common
      )
      self.kv_cache = state.cache
    else:
      generate = self._generate_fn(params, spec)
      result, self.kv_cache = rollout.run_rollout(
        generate,
        cache,
        envs[:slots],
        fmt,
        episodes,
        rc,
        rng,
        legal_answers=self.cfg.sampler.legal_answers,
        expert_answers=expert_answers,
        **common,
      )
    if not evaluation:
      longest = max(s.context_len for s in result.episodes)
      self._cache_need = longest + self.cfg.rollout.max_new_tokens
    return result

  def _slot_programs(self, spec: engine.GenerationSpec) -> slots_lib.SlotPrograms:
    """The continuous-batching programs of ``spec`` (jitted once; inputs carry the layout)."""
    if spec not in self._slot_cache:
      steps = min(self.cfg.rollout.decode_steps, self.cfg.rollout.max_new_tokens)
      self._slot_cache[spec] = slots_lib.SlotPrograms(self.graphdef, spec, steps=steps)
    return self._slot_cache[spec]

  def _generate_fn(self, params: nnx.State, spec: engine.GenerationSpec):
    plan = self.plans[Stage.ROLLOUT]
    row2, row1 = mesh_lib.batch_sharding(plan, 2), mesh_lib.batch_sharding(plan, 1)
    rep = executables.replicated(plan)

    def generate(kv_cache, prompt, mask, positions, active, rng, *answer_bits):
      program = self.programs.rollout(plan, spec, prompt.shape, kv_cache.max_len)
      host = [put(x, s) for x, s in zip((prompt, mask, positions, active), (row2,) * 3 + (row1,))]
      bits = [put(x, row1) for x in answer_bits]  # sampler.legal_answers: each row's legal moves
      out, kv_cache = program(params, kv_cache, *host, put(rng, rep), *bits)
      return fetch(out), kv_cache

    return generate

  def score(self, batch: batches.RolloutBatch) -> batches.ScoredBatch:
    """The rollout batch on the reference layout with the log-probs the objective reads.

    pi_old is scored only when something reads it (several optimiser steps, or KL in the
    reward); with one step the objective uses stop_gradient(new log-probs) instead. An unread
    field is zeros made on the devices.
    """
    rl, plan = self.cfg.rl, self.plans[Stage.REFERENCE]
    rb = jax.tree.map(put, batch, batch_shardings(plan, batch))
    program = self.programs.score(plan, rb.tokens_BxT.shape)
    args = (rb.tokens_BxT, rb.positions_BxT, rb.valid_BxT)
    if self.cfg.sampler.legal_answers:
      args += (rb.answer_bits_BxT,)
    old = ref = None
    if rl.needs_old_logps:
      policy_params, _ = dispatcher.sync_weights(self.state.params, plan)
      old = program(policy_params, *args)
    if rl.needs_ref_logps:
      ref = program(self.ref_params, *args)
    if old is None or ref is None:
      unread = _zeros(rb.tokens_BxT.shape, mesh_lib.batch_sharding(plan, 2))()
    return batches.ScoredBatch.from_rollout(
      rb,
      ref_logps_BxT=unread if ref is None else ref,
      old_logps_BxT=unread if old is None else old,
    )

  def to_update(self, batch: Any) -> tuple[Any, dispatcher.DispatchStats]:
    """A batch on the reference layout -> the update layout, device to device."""
    dst = batch_shardings(self.plans[Stage.UPDATE], batch)
    return dispatcher.dispatch(batch, dst, account=True)

  def update(self, batch: batches.AdvantageBatch) -> dict[str, jax.Array]:
    """One optimiser step (the train state is donated and replaced); returns its metrics on
    device, unfetched."""
    program = self.programs.update(self.plans[Stage.UPDATE], _abstract(batch))
    try:
      self.state, metrics = program(self.state, batch)
    except Exception as e:
      # An allocation failure before launch leaves the donated state intact (the loop re-plans
      # and retries); one after it has consumed the state cannot be retried in this process.
      if any(x.is_deleted() for x in jax.tree.leaves(self.state)):
        raise RuntimeError(
          f"the update failed on {self.plans[Stage.UPDATE].describe()} after its train state was "
          "donated, so it cannot be retried here; rerun the same command to resume from the last "
          "checkpoint"
        ) from e
      raise
    return metrics

  # --- the parallelism selector -------------------------------------------------------------

  def choose(self, stage: Stage, load: int, length: int, step: int, batch=None) -> None:
    """Asks the selector for ``stage``'s plan at this load and context length; moves the stage's
    state when the plan changes. A no-op without a selector."""
    if self.selector is None:
      return
    decision = self.selector.choose(
      stage,
      load=load,
      bucket=selector_lib.bucket_for(length, self.cfg.rollout.seq_multiple),
      compiled_memory=lambda plan: self.compiled(stage, plan, batch, length).memory,
      step=step,
      shape=self._program_shape(stage, batch, length),
    )
    if decision.plan != self.plans[stage]:
      self._relayout(stage, decision.plan)

  def _program_shape(self, stage: Stage, batch, length: int) -> int:
    """What sets ``stage``'s compiled program besides plan, load and bucket: the rollout's cache
    length, the others' exact sequence length (one bucket holds several of each)."""
    if stage is Stage.ROLLOUT:
      return self._cache_length(length)
    return batch.tokens_BxT.shape[1]

  def replan_after_oom(
    self, stage: Stage, load: int, length: int, step: int, error: BaseException, batch=None
  ) -> None:
    """``stage`` ran out of device memory on its plan: that plan is never chosen again for this
    bucket at this load or more, and the selector picks the next one (NoFeasiblePlanError, with
    every rejection, when none is left)."""
    bucket = selector_lib.bucket_for(length, self.cfg.rollout.seq_multiple)
    plan, cause = self.plans[stage], " ".join(str(error).split())[:300]
    self.selector.mark_infeasible(stage, bucket, plan, load=load, reason=f"OOM at run: {cause}")
    if self.selector.metrics is not None:
      event = {"stage": stage.value, "bucket": bucket, "load": load, "plan": plan.describe()}
      self.selector.metrics.write_event(step, "out_of_memory", {**event, "error": cause})
    self.choose(stage, load, length, step, batch)

  def _relayout(self, stage: Stage, plan: StagePlan) -> None:
    """Adopts ``plan`` for ``stage``: its state moves there on device (no host round trip)."""
    self.plans = ParallelPlan.of({**dict(self.plans), stage: plan})
    if stage is Stage.ROLLOUT:  # every slot is reset at its first episode anyway
      self.kv_cache = self._new_kv_cache(self._cache_need)
    elif stage is Stage.REFERENCE:
      self.ref_params, _ = dispatcher.sync_weights(self.ref_params, plan)
    else:
      shardings = executables.train_state_shardings(plan, self.state, self.optimizer)
      self.state, _ = dispatcher.dispatch(self.state, shardings)
