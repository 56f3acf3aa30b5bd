"""The training loop: the only module that knows every stage, the dispatcher and the plans.

One step: rollout@ROLLOUT (multi-turn episodes, KV cache across turns) -> RolloutBatch, put on the
REFERENCE layout -> old-policy and reference log-probs -> advantages (jitted, on device, group
statistics included) -> dispatch to the UPDATE layout -> update -> weight sync back to the
rollout (and reference) layouts. Each stage is a compiled program of its StagePlan and length
bucket (``parallel/executables.py``); the dispatcher moves the batch and the weights between
layouts without a host round trip.

Resume is exact: every random choice of step k (sampling key, environment seeds) is derived from
(config seed, k), and a checkpoint holds the train state, the reference weights and the step.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from earl_jax import checkpoint as checkpoint_lib
from earl_jax import config_lib
from earl_jax import metrics as metrics_lib
from earl_jax import model as model_lib
from earl_jax import workdir as workdir_lib
from earl_jax.model import hf_import
from earl_jax.parallel import dispatcher, executables
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel import selector as selector_lib
from earl_jax.parallel.plan import ParallelPlan, StagePlan
from earl_jax.rl import (
  advantage,
  batches,
  loop_stats,
  objective,
  preflight,
  programs,
  rollout,
  turn_format,
  update,
)
from earl_jax.sampler import engine
from earl_jax.types import Stage

_ENV_SEED_STRIDE = 1_000_003  # env seeds of different config seeds never collide in practice
_EVAL_SEED_BASE = 10**9  # evaluation episodes use a fixed, disjoint seed range


def _turn_format(tokenizer: model_lib.Tokenizer):
  if isinstance(tokenizer, model_lib.CharTokenizer):
    return turn_format.PlainFormat(tokenizer)
  return turn_format.ChatTemplateFormat(tokenizer)


@dataclasses.dataclass
class _Programs:
  """Stage programs and their static pieces, shared by training and evaluation."""

  cfg: config_lib.ExperimentConfig
  plans: ParallelPlan
  graphdef: nnx.GraphDef
  abstract_params: nnx.State
  optimizer: Any
  abstract_train_state: Any = None
  cache: executables.ExecutableCache = dataclasses.field(
    default_factory=executables.ExecutableCache
  )

  def generate_fn(self, params: nnx.State, spec: engine.GenerationSpec):
    """A rollout ``generate`` with ``params`` bound; compiles one program per chunk width."""
    plan = self.plans[Stage.ROLLOUT]
    cache_len = self.cfg.rollout.cache_len()
    row2, row1 = mesh_lib.batch_sharding(plan, 2), mesh_lib.batch_sharding(plan, 1)
    rep = executables.replicated(plan)

    def generate(kv_cache, prompt, mask, positions, active, rng):
      b, p = prompt.shape
      program = self.cache.get(
        Stage.ROLLOUT,
        plan,
        (b, p),
        lambda: executables.lower_generate(
          plan, self.graphdef, self.abstract_params, cache_len, spec, (b, p)
        ),
        extra=spec,
      )
      host = [_put(x, s) for x, s in zip((prompt, mask, positions, active), (row2,) * 3 + (row1,))]
      out, kv_cache = program(params, kv_cache, *host, _put(rng, rep))
      return _fetch(out), kv_cache

    return generate

  def score(self, params: nnx.State, batch: batches.RolloutBatch, plan=None) -> jax.Array:
    plan = plan or self.plans[Stage.REFERENCE]
    bucket = batch.tokens_BxT.shape
    program = self.cache.get(
      Stage.REFERENCE,
      plan,
      bucket,
      lambda: programs.lower_score(
        plan,
        self.graphdef,
        self.abstract_params,
        bucket,
        chunk_size=self.cfg.rl.logp_chunk,
        temperature=self.cfg.sampler.temperature,
      ),
    )
    if params is None:  # memory check only
      return program
    return program(params, batch.tokens_BxT, batch.positions_BxT, batch.valid_BxT)

  def update(self, state: update.TrainState, batch: batches.AdvantageBatch, plan=None):
    plan = plan or self.plans[Stage.UPDATE]
    bucket = batch.tokens_BxT.shape
    rl = self.cfg.rl
    loss_fn = objective.Objective(
      rl.loss,
      chunk_size=rl.logp_chunk,
      temperature=self.cfg.sampler.temperature,
      remat=plan.remat,
      old_from_new=rl.optimizer_steps == 1,
      reference_scored=rl.needs_ref_logps,
    )
    abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    abstract_state = self.abstract_train_state
    program = self.cache.get(
      Stage.UPDATE,
      plan,
      bucket,
      lambda: programs.lower_update(
        plan,
        self.graphdef,
        abstract_state,
        abstract_batch,
        loss_fn=loss_fn,
        optimizer=self.optimizer,
        totals_fn=loss_fn.totals,
        num_mini_batches=rl.mini_batches,
        num_epochs=rl.ppo_epochs,
      ),
    )
    if state is None:  # memory check only
      return program
    return program(state, batch)


def _advantage_shapes(batch: batches.RolloutBatch) -> batches.AdvantageBatch:
  zeros = jnp.zeros(batch.tokens_BxT.shape, jnp.float32)
  scored = batches.ScoredBatch.from_rollout(batch, ref_logps_BxT=zeros, old_logps_BxT=zeros)
  return batches.AdvantageBatch.from_scored(scored, advantages_BxT=zeros, returns_BxT=zeros)


def _put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
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


def _put_tree(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(_put, tree, shardings)


def _fetch(tree: Any) -> Any:
  """Device arrays -> host numpy on every process (small rollout outputs the env loop needs)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def _batch_shardings(plan: StagePlan, batch: Any) -> Any:
  return jax.tree.map(lambda x: mesh_lib.batch_sharding(plan, np.ndim(x)), batch)


class Trainer:
  """Holds the run's state; ``run()`` trains from the last checkpoint (if any) to the end."""

  def __init__(
    self,
    cfg: config_lib.ExperimentConfig,
    workdir: str | pathlib.Path,
    *,
    allow_config_change: bool = False,
  ):
    """Checks everything that can be checked without devices (workdir writable and free, device
    count, tokenizer and pretrained files, layouts vs the model and batches, the config against
    the checkpoint a resume would read), then builds the model on the devices.

    Raises (before any device work): ConfigError, WorkdirError, CheckpointError.
    """
    self.cfg = cfg
    self.allow_config_change = allow_config_change
    self.workdir = workdir_lib.check_writable(workdir)
    self._lock = workdir_lib.WorkdirLock(self.workdir, jax.process_index()).acquire()
    self.checkpointer = None
    self._config_checked: set[int] = set()
    try:
      self._preflight()
      self._build()
    except BaseException:
      self.close()  # the workdir is free again for the corrected run
      raise

  def _build(self) -> None:
    """The device work of ``__init__``: the model, optimiser and reference on their layouts."""
    cfg = self.cfg
    if self.model_cfg is not cfg.model:
      logging.info(
        "model: architecture from %s; param_dtype=%s, compute_dtype=%s from the config",
        cfg.pretrained_path,
        self.model_cfg.param_dtype.value,
        self.model_cfg.compute_dtype.value,
      )
    self.fmt = _turn_format(self.tokenizer)
    self.optimizer = update.make_optimizer(cfg.optim)
    self._init_state()
    self.programs = _Programs(
      cfg,
      self.plans,
      self.graphdef,
      self.abstract_params,
      self.optimizer,
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state),
    )
    self.selector = None
    if cfg.parallel.selector:
      budget = int(cfg.parallel.memory_budget_gib * 2**30) or None  # None: device.memory_stats()
      self.selector = selector_lib.Selector(
        self.model_cfg,
        self.devices,
        memory_budget_bytes=budget,
        profile_path=str(self.workdir / "selector_profile.json"),
        prompt_chunk=cfg.rollout.chunk_multiple,
        new_tokens=cfg.rollout.max_new_tokens,
        logits_chunk=cfg.rl.logp_chunk,
      )
    self._context_bucket = cfg.rollout.seq_multiple
    self.envs = [cfg.env.make() for _ in range(cfg.rollout.num_slots)]
    self.kv_cache = self._new_cache()
    self._advantages = jax.jit(
      functools.partial(
        advantage.compute_advantages, cfg=cfg.rl.advantage, num_groups=cfg.rl.num_groups
      )
    )

  def _preflight(self) -> None:
    setup = preflight.check_run(self.cfg)
    self.devices, self.tokenizer, self.plans = setup.devices, setup.tokenizer, setup.plans
    self.model_cfg, self._pretrained_dir = setup.model_cfg, setup.pretrained_dir
    self.checkpointer = self._open_checkpointer()
    # The newest checkpoint whose meta reads is the one resume starts from (unless its arrays
    # turn out damaged: restore compares each candidate again).
    for step in reversed(self.checkpointer.all_steps()):
      try:
        meta = self.checkpointer.read_meta(step)
      except checkpoint_lib.DamagedCheckpointError:
        continue
      self._compare_config(step, meta)
      return

  def _open_checkpointer(self) -> checkpoint_lib.Checkpointer:
    train = self.cfg.train
    return checkpoint_lib.Checkpointer(
      self.workdir / "checkpoints", save_every=train.checkpoint_every, keep=train.keep_checkpoints
    )

  def _compare_config(self, step: int, meta: dict[str, Any]) -> None:
    if step not in self._config_checked:
      self._config_checked.add(step)
      preflight.compare_config(
        self.cfg,
        step,
        meta,
        self.checkpointer.directory,
        allow_config_change=self.allow_config_change,
      )

  def close(self) -> None:
    """Waits for checkpoint writes and releases the workdir (``run`` does this when it ends)."""
    try:
      if getattr(self, "checkpointer", None) is not None:
        self.checkpointer.close()
        self.checkpointer = None
    finally:
      self._lock.release()

  def _init_state(self) -> None:
    cfg, plan = self.cfg, self.plans[Stage.UPDATE]
    if cfg.pretrained_path:
      # Read on the host, then laid out on the update plan (direct sharded loading: follow-up).
      pretrained = hf_import.load_weights(self._pretrained_dir, self.model_cfg)
      graphdef, params = nnx.split(pretrained)
      model = nnx.merge(graphdef, jax.device_put(params, mesh_lib.state_shardings(params, plan)))
    else:
      init = lambda: model_lib.Decoder(self.model_cfg, rngs=nnx.Rngs(cfg.seed))  # noqa: E731
      model = mesh_lib.create_sharded(init, plan)
    self.graphdef, params = nnx.split(model)
    self.abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    rng = jax.random.key(cfg.seed)
    state = update.init_train_state(params, self.optimizer, rng)
    self.state_shardings = executables.train_state_shardings(plan, state, self.optimizer)
    self.state = _put_tree(state, self.state_shardings)
    # The frozen reference must own its buffers: with equal layouts the sync is a no-op that
    # would alias the policy's parameters, which the update step donates.
    ref_params, _ = dispatcher.sync_weights(params, self.plans[Stage.REFERENCE])
    self.ref_params = jax.tree.map(jnp.copy, ref_params)
    self.start_step = 0

  def _new_cache(self) -> model_lib.KVCache:
    plan, cfg = self.plans[Stage.ROLLOUT], self.cfg
    abstract = jax.eval_shape(
      lambda: model_lib.init_cache(self.model_cfg, cfg.rollout.num_slots, cfg.rollout.cache_len())
    )
    shardings = executables.cache_shardings(plan, abstract)
    return jax.jit(
      lambda: model_lib.init_cache(self.model_cfg, cfg.rollout.num_slots, cfg.rollout.cache_len()),
      out_shardings=shardings,
    )()

  def spec(self, *, evaluation: bool = False) -> engine.GenerationSpec:
    return engine.GenerationSpec.with_stop_ids(
      tuple(self.tokenizer.stop_ids),
      strategy=self.cfg.sampler.make(evaluation=evaluation),
      max_new_tokens=self.cfg.rollout.max_new_tokens,
      pad_id=self.tokenizer.pad_id,
    )

  def episodes(self, step: int) -> list[rollout.EpisodeSpec]:
    """Step ``step``'s episodes: group g shares one env seed (its initial state and opponent)."""
    rl, base = self.cfg.rl, self.cfg.seed * _ENV_SEED_STRIDE + step * self.cfg.rl.num_groups
    return [
      rollout.EpisodeSpec(seed=base + g, group_id=g)
      for g in range(rl.num_groups)
      for _ in range(rl.group_size)
    ]

  def play(self, params: nnx.State, episodes, envs, rng, *, evaluation: bool = False):
    generate = self.programs.generate_fn(params, self.spec(evaluation=evaluation))
    result, self.kv_cache = rollout.run_rollout(
      generate,
      self.kv_cache,
      envs,
      self.fmt,
      episodes,
      self.cfg.rollout,
      rng,
      pad_id=self.tokenizer.pad_id,
    )
    return result

  def train_step(self, step: int, timer: metrics_lib.StageTimer) -> dict[str, Any]:
    """One RL step; returns host scalars (the update's metrics are fetched last)."""
    cfg = self.cfg
    rng = jax.random.fold_in(jax.random.key(cfg.seed), step)
    if self.selector is not None:
      with timer("select"):
        # EARL: the rollout layout is chosen before rollout from the current context range.
        self._select(Stage.ROLLOUT, cfg.rollout.num_slots, self._context_bucket, step)
    with timer("sync"):
      rollout_params, sync_stats = dispatcher.sync_weights(
        self.state.params, self.plans[Stage.ROLLOUT], account=True
      )
    with timer("rollout"):
      result = self.play(rollout_params, self.episodes(step), self.envs, rng)
    bucket = result.batch.tokens_BxT.shape[1]
    self._context_bucket = bucket
    if self.selector is not None:
      with timer("select"):
        self._select(Stage.REFERENCE, cfg.rl.batch_size, bucket, step, result.batch)
        self._select(Stage.UPDATE, cfg.rl.batch_size, bucket, step, result.batch)
    ref_plan = self.plans[Stage.REFERENCE]
    with timer("reference"):
      rb = _put_tree(result.batch, _batch_shardings(ref_plan, result.batch))
      # pi_old is scored only when something reads it (several optimiser steps, or KL in the
      # reward); with one step the objective uses stop_gradient(new log-probs) instead.
      old = None
      if cfg.rl.needs_old_logps:
        policy_params, _ = dispatcher.sync_weights(self.state.params, ref_plan)
        old = self.programs.score(policy_params, rb)
      ref = self.programs.score(self.ref_params, rb) if cfg.rl.needs_ref_logps else None
      unread = jnp.zeros(rb.tokens_BxT.shape, jnp.float32)
      unread = jax.device_put(unread, _batch_shardings(ref_plan, unread))
      scored = batches.ScoredBatch.from_rollout(
        rb,
        ref_logps_BxT=unread if ref is None else ref,
        old_logps_BxT=unread if old is None else old,
      )
      adv = self._advantages(scored)
    with timer("dispatch"):
      lengths = np.asarray(result.batch.valid_BxT.sum(axis=1))
      adv, dispatch_stats = dispatcher.dispatch(
        adv, _batch_shardings(self.plans[Stage.UPDATE], adv), lengths_B=lengths, account=True
      )
    with timer("update"):
      # The update donates the train state: a checkpoint still reading it must finish first
      # (its disk writes overlapped with this step's rollout).
      self.checkpointer.wait()
      self.state, upd = self.programs.update(self.state, adv)
      upd = jax.device_get(upd)
    out = loop_stats.rollout_scalars(result)
    out.update({f"update/{k}": float(v) for k, v in upd.items()})
    out.update(loop_stats.dispatch_scalars(dispatch_stats, "dispatch"))
    out.update(loop_stats.dispatch_scalars(sync_stats, "sync"))
    out["lr"] = float(update.learning_rate_schedule(cfg.optim)(step * cfg.rl.optimizer_steps))
    return out

  def _select(self, stage: Stage, load: int, bucket: int, step: int, batch=None) -> None:
    """Asks the selector for ``stage``'s plan; moves the stage's state when the plan changes."""

    def compiled_memory(plan: StagePlan) -> executables.MemoryStats:
      return self._program_for(stage, plan, batch).memory

    decision = self.selector.choose(
      stage,
      load=load,
      bucket=selector_lib.bucket_for(bucket, self.cfg.rollout.seq_multiple),
      compiled_memory=compiled_memory,
      step=step,
    )
    if decision.plan != self.plans[stage]:
      self._relayout(stage, decision.plan)

  def _program_for(self, stage: Stage, plan: StagePlan, batch) -> Any:
    if stage is Stage.ROLLOUT:
      b, p, spec = self.cfg.rollout.num_slots, self.cfg.rollout.chunk_multiple, self.spec()
      cache_len = self.cfg.rollout.cache_len()
      return self.programs.cache.get(
        stage,
        plan,
        (b, p),
        lambda: executables.lower_generate(
          plan, self.graphdef, self.abstract_params, cache_len, spec, (b, p)
        ),
        extra=spec,
      )
    if stage is Stage.REFERENCE:
      return self.programs.score(None, batch, plan)
    return self.programs.update(None, jax.eval_shape(lambda: _advantage_shapes(batch)), plan)

  def _relayout(self, stage: Stage, plan: StagePlan) -> None:
    """Adopts ``plan`` for ``stage``: its state moves there on device (no host round trip)."""
    self.plans = ParallelPlan.of({**dict(self.plans), stage: plan})
    self.programs.plans = self.plans
    if stage is Stage.ROLLOUT:
      self.kv_cache = self._new_cache()  # every slot is reset at its first episode anyway
    elif stage is Stage.REFERENCE:
      self.ref_params, _ = dispatcher.sync_weights(self.ref_params, plan)
    else:
      shardings = executables.train_state_shardings(plan, self.state, self.optimizer)
      self.state, _ = dispatcher.dispatch(self.state, shardings)
      self.state_shardings = shardings

  def evaluate(self, step: int) -> dict[str, float]:
    cfg, out = self.cfg, {}
    rollout_params, _ = dispatcher.sync_weights(self.state.params, self.plans[Stage.ROLLOUT])
    opponents = cfg.train.eval_opponents if cfg.env.name != "calculator" else ("",)
    for opponent in opponents:
      overrides = {"opponent": opponent} if opponent else {}
      envs = [cfg.env.make(**overrides) for _ in range(cfg.rollout.num_slots)]
      n = rollout.round_up(cfg.train.eval_episodes, cfg.rollout.num_slots)
      episodes = [rollout.EpisodeSpec(seed=_EVAL_SEED_BASE + i, group_id=0) for i in range(n)]
      result = self.play(rollout_params, episodes, envs, jax.random.key(step), evaluation=True)
      name = opponent or "calculator"
      out.update(loop_stats.outcome_rates(result.episodes, f"eval/{name}"))
    return out

  def checkpoint_state(self) -> dict[str, Any]:
    return {"train": self.state, "reference": self.ref_params}

  def restore(self, ckpt: checkpoint_lib.Checkpointer, resume: str = "auto") -> None:
    """``resume``: "auto" (the newest readable checkpoint if any), "required" (error if none),
    "never". Unreadable newer steps are reported, moved aside and skipped; each candidate's saved
    config is compared with this run's first (``ConfigChangedError``)."""
    if resume not in ("auto", "required", "never"):
      raise ValueError(f"resume={resume!r}; allowed: 'auto', 'required', 'never'")
    if resume == "never":
      return
    if ckpt.latest_step() is None:
      if resume == "required":
        raise FileNotFoundError(f"no checkpoint to resume from in {ckpt.directory}")
      return
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.checkpoint_state()
    )
    restored, meta, damaged = ckpt.restore_newest_readable(
      abstract_state=abstract, check_meta=self._compare_config
    )
    self.state, self.ref_params = restored["train"], restored["reference"]
    self.start_step = int(meta["step"]) + 1
    if damaged:
      logging.warning(
        "resumed from step %d: newer steps %s were unreadable and moved to %s",
        meta["step"],
        damaged,
        ckpt.damaged_directory,
      )
    logging.info("resumed from step %d (%s)", meta["step"], ckpt.directory)

  def run(self, resume: str = "auto") -> list[dict[str, Any]]:
    """Trains to ``cfg.train.num_steps``; returns the metrics rows written by this call.

    Ends the run (checkpoint writes finished, workdir released) however it stops. Stops early,
    after saving, on SIGTERM to any process (all processes agree on the step) and when
    ``train.max_nonfinite_steps`` optimiser steps in a row were skipped (``NonFiniteError``).
    """
    cfg = self.cfg
    if self.checkpointer is None:  # run() again after an earlier run() ended
      self._lock.acquire()
      self.checkpointer = self._open_checkpointer()
    ckpt = self.checkpointer
    writer, uninstall = None, lambda: None
    try:
      self.restore(ckpt, resume)
      uninstall = checkpoint_lib.install_preemption_handler()
      # One metrics stream per process: process 0 writes the workdir's, others their own folder.
      pid = jax.process_index()
      metrics_dir = self.workdir if pid == 0 else self.workdir / f"process_{pid}"
      writer = metrics_lib.MetricsWriter(
        metrics_dir, config=config_lib.to_dict(cfg), resume_step=self.start_step - 1
      )
      return self._train(ckpt, writer)
    finally:
      if writer is not None:
        writer.close()
      uninstall()
      self.close()

  def _train(self, ckpt: checkpoint_lib.Checkpointer, writer: metrics_lib.MetricsWriter):
    cfg = self.cfg
    writer.write_event(self.start_step, "plan", {"plan": self.plans.describe()})
    if self.selector is not None:
      self.selector.metrics = writer  # every decision goes to events.jsonl
    progress = metrics_lib.Progress(cfg.train.num_steps, initial=self.start_step)
    profile = metrics_lib.ProfileWindow(cfg.train.profile_steps, self.workdir / "profile")
    rows, timer = [], metrics_lib.StageTimer()
    try:
      for step in range(self.start_step, cfg.train.num_steps):
        ckpt.check()  # a failed background write stops the run here, once, with its cause
        start = time.perf_counter()
        profile.begin(step)
        scalars = self.train_step(step, timer)
        profile.end(step)
        last = step == cfg.train.num_steps - 1
        if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
          with timer("eval"):
            scalars.update(self.evaluate(step))
        scalars.update(timer.summary(reset=True))
        scalars["time/step"] = time.perf_counter() - start
        scalars["tokens_per_second"] = scalars["rollout/generated_tokens"] / scalars["time/rollout"]
        scalars["compilations"] = self.programs.cache.compilations
        streak = int(scalars.get("update/nonfinite_streak", 0))
        diverged = streak >= cfg.train.max_nonfinite_steps
        if step % cfg.train.log_every == 0 or last or diverged or "eval/" in "".join(scalars):
          writer.write(step, scalars)
          rows.append({"step": step, **scalars})
        progress.update(step + 1, scalars)
        meta = {"step": step, "plan": self.plans.to_json(), "config": config_lib.to_dict(cfg)}
        stop = _any_process(checkpoint_lib.preempted())
        # Skipped updates leave the weights and moments as they were: this is the last good state.
        ckpt.save(step, state=self.checkpoint_state(), meta=meta, force=last or stop or diverged)
        if diverged:
          ckpt.wait()
          raise NonFiniteError(
            f"the last {streak} optimiser steps had non-finite gradients and were skipped "
            f"(train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}; loss "
            f"{scalars.get('update/loss')}); the last good state is checkpoint step {step} in "
            f"{ckpt.directory}. Lower optim.learning_rate or check the rewards, then resume with "
            "--allow_config_change"
          )
        if stop:
          ckpt.wait()
          logging.warning("SIGTERM: saved step %d, exiting", step)
          break
    finally:
      profile.close()
      progress.close()  # the bar ends its line before any error message
    return rows


class NonFiniteError(RuntimeError):
  """Training stopped: too many optimiser steps in a row had non-finite gradients."""


def _any_process(flag: bool) -> bool:
  """True if ``flag`` is set on any process (a small all-gather; every process must call it at
  the same point, as the loop does once per step)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


def run(
  cfg: config_lib.ExperimentConfig,
  workdir: str | pathlib.Path,
  *,
  allow_config_change: bool = False,
) -> list[dict[str, Any]]:
  """Builds a Trainer for ``cfg`` and trains; the entry point of ``launch/train.py``."""
  return Trainer(cfg, workdir, allow_config_change=allow_config_change).run()
