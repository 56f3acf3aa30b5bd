"""The learner: the RL step and the run around it (resume, checkpoints, metrics, stops).

One step, on the stage resources of ``rl/stages.py`` (which own plans, programs, weights, the KV
cache and the selector; the learner never sees a sharding): weight sync -> rollout (multi-turn
episodes, KV cache across turns) -> RolloutBatch -> old-policy and reference log-probs on the
reference layout -> advantages (jitted, on device, group statistics included) -> dispatch to the
update layout -> update. Environments name their own evaluation suites (``EnvConfig.evaluations``).

Resume is exact: every random choice of step k (sampling key, environment seeds) is derived from
(config seed, k), and a checkpoint holds the train state, the reference weights and the step.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import signal
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from earl_jax import checkpoint as checkpoint_lib
from earl_jax import config_lib, preemption
from earl_jax import metrics as metrics_lib
from earl_jax import workdir as workdir_lib
from earl_jax.parallel import selector as selector_lib
from earl_jax.parallel.plan import ParallelPlan
from earl_jax.rl import advantage, loop_stats, preflight, rollout, turn_format, update
from earl_jax.rl import stages as stages_lib
from earl_jax.types import Stage

_ENV_SEED_STRIDE = 1_000_003  # env seeds of different config seeds never collide in practice
# SIGTERM (schedulers, preemption) and Ctrl-C stop at the end of the step, after saving it.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_EVAL_SEED_BASE = 10**9  # evaluation episodes use a fixed, disjoint seed range


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
    self._compiled_seconds: dict[str, float] = {}  # the cache's totals at the last row
    self._baselines: dict[str, Any] | None = None  # baselines(), once played or read back
    self._baselines_recorded = False  # whether the workdir's events hold that table
    try:
      self._preflight()
      self._build()
    except BaseException:
      self.close()  # the workdir is free again for the corrected run
      raise

  def _build(self) -> None:
    """The device work of ``__init__``: the stages' weights, programs and KV cache."""
    cfg = self.cfg
    if self.setup.model_cfg is not cfg.model:
      logging.info(
        "model: architecture from %s; param_dtype=%s, compute_dtype=%s from the config",
        cfg.pretrained_path,
        self.setup.model_cfg.param_dtype.value,
        self.setup.model_cfg.compute_dtype.value,
      )
    self.fmt = turn_format.for_tokenizer(self.setup.tokenizer)
    self.stages = stages_lib.StageResources(cfg, self.setup, self.workdir)
    self.start_step = 0
    self._context_length = cfg.rollout.seq_multiple
    self.envs = [cfg.env.make() for _ in range(cfg.rollout.num_slots)]
    self._advantages = jax.jit(
      functools.partial(
        advantage.compute_advantages, cfg=cfg.rl.advantage, num_groups=cfg.rl.num_groups
      )
    )

  def _preflight(self) -> None:
    self.setup = preflight.check_run(self.cfg)
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

  @property
  def state(self) -> update.TrainState:
    """The policy's train state (on the update layout)."""
    return self.stages.state

  @property
  def plans(self) -> ParallelPlan:
    return self.stages.plans

  def episodes(self, step: int) -> list[rollout.EpisodeSpec]:
    """Step ``step``'s episodes: group g shares one env seed (its initial state and opponent)."""
    rl, base = self.cfg.rl, self.cfg.seed * _ENV_SEED_STRIDE + step * self.cfg.rl.num_groups
    return [
      rollout.EpisodeSpec(seed=base + g, group_id=g)
      for g in range(rl.num_groups)
      for _ in range(rl.group_size)
    ]

  def train_step(
    self, step: int, timer: metrics_lib.StageTimer
  ) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """One RL step, dispatched: host scalars (rollout, dispatch) and the update's metrics and
    learning rate as device arrays, not waited for (``_RowLog.finish`` fetches them a step
    later)."""
    cfg, stages = self.cfg, self.stages
    rng = jax.random.fold_in(jax.random.key(cfg.seed), step)
    loads = {stage: stages_lib.selector_load(cfg, stage) for stage in Stage}
    slots = loads[Stage.ROLLOUT]
    if stages.selector is not None:
      with timer("select"):  # EARL: the rollout layout follows the current context range
        stages.choose(Stage.ROLLOUT, slots, self._context_length, step)

    def play():
      with timer("sync"):
        params, sync_stats = stages.rollout_weights()
      with timer("rollout"):
        expert = cfg.rl.imitating(step)  # the imitation term's labels, while it is on
        result = stages.rollout(
          params, self.episodes(step), self.envs, self.fmt, rng, expert_answers=expert
        )
        return result, sync_stats

    result, sync_stats = self._retrying(Stage.ROLLOUT, slots, self._context_length, step, play)
    self._context_length = length = result.batch.tokens_BxT.shape[1]
    if stages.selector is not None:
      with timer("select"):
        for stage in (Stage.REFERENCE, Stage.UPDATE):
          stages.choose(stage, loads[stage], length, step, result.batch)

    def score():
      with timer("reference"):
        return self._advantages(stages.score(result.batch))

    def learn():
      with timer("dispatch"):
        dispatched, stats = stages.to_update(adv)
      with timer("update"):
        # The update donates the train state: a checkpoint still reading it must finish first
        # (its disk writes overlapped with this step's rollout).
        self.checkpointer.wait()
        return stages.update(dispatched), stats

    retry = functools.partial(self._retrying, length=length, step=step, batch=result.batch)
    adv = retry(Stage.REFERENCE, loads[Stage.REFERENCE], run=score)
    update_metrics, dispatch_stats = retry(Stage.UPDATE, loads[Stage.UPDATE], run=learn)
    out = loop_stats.rollout_scalars(result, cfg.env.success)
    out.update(loop_stats.dispatch_scalars(dispatch_stats, "dispatch"))
    out.update(loop_stats.dispatch_scalars(sync_stats, "sync"))
    on_device = {f"update/{k}": v for k, v in update_metrics.items()}
    on_device["lr"] = update.learning_rate_schedule(cfg.optim)(step * cfg.rl.optimizer_steps)
    return out, on_device

  def _retrying(self, stage: Stage, load: int, length: int, step: int, run, batch=None):
    """``run()``: one stage's work on its current plan. When it runs out of device memory and a
    selector is on, that plan is marked infeasible for this bucket and load, the selector picks
    the next (its state moves there) and the work runs again: the step is not lost. Raises
    NoFeasiblePlanError, with every rejection, when no plan is left."""
    while True:
      try:
        return run()
      except Exception as e:
        if self.stages.selector is None or not selector_lib.is_resource_exhausted(e):
          raise
        logging.warning(
          "step %d: %s ran out of device memory on %s; re-planning",
          step, stage.value, self.plans[stage].describe(),
        )  # fmt: skip
        self.stages.replan_after_oom(stage, load, length, step, e, batch)

  def _eval_seeds(self, episodes: int = 0) -> range:
    """The evaluation's episode seeds: ``episodes`` (default ``train.eval_episodes``) rounded up
    to whole waves of slots; a longer evaluation starts with the same seeds."""
    n = episodes or self.cfg.train.eval_episodes
    n = rollout.round_up(n, self.cfg.rollout.num_slots)
    return range(_EVAL_SEED_BASE, _EVAL_SEED_BASE + n)

  def baselines(self) -> dict[str, Any]:
    """The reference lines of the eval curves: each ``train.baselines`` policy's win rate
    against each eval opponent, on the evaluation's own episode seeds. Played once per workdir
    (kept as its ``baselines`` event, which later calls and resumed runs read back); {} when
    none are configured. Payload: ``{"episodes", "seconds", "win_rate": {baseline: {opponent:
    rate}}}``."""
    cfg = self.cfg
    if not cfg.train.baselines:
      return {}
    if self._baselines is None:
      known = metrics_lib.read_events(self.workdir, kind="baselines")
      self._baselines_recorded = bool(known) and known[-1].get("specs") == list(cfg.train.baselines)
      if self._baselines_recorded:
        self._baselines = {k: known[-1][k] for k in ("episodes", "seconds", "win_rate")}
      else:
        start, seeds = time.perf_counter(), self._eval_seeds()
        table = cfg.env.baselines(cfg.train.baselines, cfg.train.eval_opponents, seeds)
        seconds = time.perf_counter() - start
        self._baselines = {"episodes": len(seeds), "seconds": seconds, "win_rate": table}
    return self._baselines

  def evaluate(self, step: int, episodes: int = 0) -> dict[str, float]:
    """Greedy episodes (``episodes`` per suite, default ``train.eval_episodes``) on each of the
    env's evaluation suites (it names them); ``eval/episodes`` says how many."""
    cfg = self.cfg
    seeds = self._eval_seeds(episodes)
    out = {"eval/episodes": len(seeds)}
    params, _ = self.stages.rollout_weights()
    specs = [rollout.EpisodeSpec(seed=s, group_id=0) for s in seeds]
    for name, overrides in cfg.env.evaluations(cfg.train.eval_opponents):
      envs = [cfg.env.make(**overrides) for _ in range(cfg.rollout.num_slots)]
      rng = jax.random.key(step)
      result = self.stages.rollout(params, specs, envs, self.fmt, rng, evaluation=True)
      out.update(loop_stats.outcome_rates(result.episodes, f"eval/{name}", cfg.env.success))
    return out

  def play(self, opponent: str = "", seed: int = _EVAL_SEED_BASE) -> list[dict[str, Any]]:
    """One greedy episode of the current policy, as a transcript: the first observation, then
    per policy turn its reply, what the env answered, the reward, the outcome and (games) the
    board after the opponent's answer. ``opponent``: an evaluation opponent ("mcts", "random",
    ...; games only); "" plays the training env."""
    cfg = self.cfg
    suites = cfg.env.evaluations((opponent,)) if opponent else [("train", {})]
    recorder = _Transcript(cfg.env.make(**suites[0][1]))
    envs = [recorder] + [cfg.env.make() for _ in range(cfg.rollout.num_slots - 1)]
    params, _ = self.stages.rollout_weights()
    episode = [rollout.EpisodeSpec(seed=seed, group_id=0)]
    self.stages.rollout(params, episode, envs, self.fmt, jax.random.key(seed), evaluation=True)
    return recorder.turns

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
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      self.stages.checkpoint_state(),
    )
    restored, meta, damaged = ckpt.restore_newest_readable(
      abstract_state=abstract, check_meta=self._compare_config
    )
    self.stages.load_checkpoint_state(restored)
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
      uninstall = preemption.install_preemption_handler(_say_stopping, signals=_STOP_SIGNALS)
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
    """The step loop. Step k's update metrics are fetched after step k+1 is dispatched (its
    rollout needs the updated weights anyway), so the host never waits for them; its row is
    written, and a non-finite streak acted on, then."""
    cfg = self.cfg
    if self.start_step >= cfg.train.num_steps:
      return []  # a finished run: nothing to train, no bar to draw (the launcher says so)
    writer.write_event(self.start_step, "plan", {"plan": self.plans.describe()})
    if self.baselines() and not self._baselines_recorded:  # played now, not read back
      specs = list(cfg.train.baselines)
      writer.write_event(self.start_step, "baselines", {"specs": specs, **self.baselines()})
      self._baselines_recorded = True
    if self.stages.selector is not None:
      self.stages.selector.metrics = writer  # every decision goes to events.jsonl
    log = _RowLog(cfg, writer, metrics_lib.Progress(cfg.train.num_steps, initial=self.start_step))
    profile = metrics_lib.ProfileWindow(cfg.train.profile_steps, self.workdir / "profile")
    timer, pending = metrics_lib.StageTimer(), None
    try:
      for step in range(self.start_step, cfg.train.num_steps):
        ckpt.check()  # a failed background write stops the run here, once, with its cause
        profile.begin(step)
        row = self._step(step, timer)
        profile.end(step)
        streak = log.finish(pending) if pending else 0
        pending, last = row, step == cfg.train.num_steps - 1
        stop = _any_process(preemption.preempted())
        diverged = streak >= cfg.train.max_nonfinite_steps
        # Skipped updates leave the weights and moments as they were, and a finite update gives
        # finite ones: the state after this step is a good one to save and stop on.
        force = last or stop or diverged
        if ckpt.should_save(step, force=force):
          # A checkpoint never runs ahead of the log: step k's row is on disk before step k is
          # saved, so a run killed after the save resumes with no row missing.
          streak, pending = max(streak, log.finish(pending)), None
        meta = {"step": step, "plan": self.plans.to_json(), "config": config_lib.to_dict(cfg)}
        ckpt.save(step, state=self.stages.checkpoint_state(), meta=meta, force=force)
        if streak >= cfg.train.max_nonfinite_steps:  # diverged, or the flushed last row did
          ckpt.wait()
          raise NonFiniteError(
            f"the last {streak} optimiser steps had non-finite gradients and were skipped "
            f"(train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}; loss "
            f"{log.last.get('update/loss')}); the last good state is checkpoint step {step} in "
            f"{ckpt.directory}. Lower optim.learning_rate or check the rewards, then resume with "
            "--allow_config_change"
          )
        if stop:
          ckpt.wait()
          logging.warning("%s: saved step %d, exiting", preemption.received(), step)
          break
    finally:
      profile.close()
      log.progress.close()  # the bar ends its line before any error message
    return log.rows

  def _step(self, step: int, timer: metrics_lib.StageTimer) -> _Row:
    """One train step (and its evaluation, if due), dispatched; timings measured on the host."""
    cfg, start = self.cfg, time.perf_counter()
    scalars, on_device = self.train_step(step, timer)
    last = step == cfg.train.num_steps - 1
    if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
      with timer("eval"):
        scalars.update(self.evaluate(step, cfg.train.final_eval_episodes if last else 0))
    scalars.update(timer.summary(reset=True))
    scalars["time/step"] = time.perf_counter() - start
    scalars["tokens_per_second"] = scalars["rollout/generated_tokens"] / scalars["time/rollout"]
    cache = self.stages.programs.cache
    scalars["compilations"] = cache.compilations
    for stage, total in cache.compile_seconds.items():  # seconds this step spent compiling
      if total > self._compiled_seconds.get(stage, 0.0):
        scalars[f"compile/{stage}_seconds"] = total - self._compiled_seconds.get(stage, 0.0)
    self._compiled_seconds = dict(cache.compile_seconds)
    return _Row(step, scalars, on_device)


class _Transcript:
  """An env that records its episode (``Trainer.play``); the rollout sees the env it wraps."""

  def __init__(self, env) -> None:
    self.env, self.turns = env, []

  def __getattr__(self, name: str):
    # Everything else the rollout asks (instructions, legal_answer_bits, ...) is the env's.
    return getattr(self.env, name)

  def _board(self) -> str | None:
    spec, state = getattr(self.env, "spec", None), getattr(self.env, "state", None)
    return None if spec is None or state is None else spec.render(state)

  def reset(self, seed: int) -> str:
    observation = self.env.reset(seed)
    self.turns = [{"observation": observation, "board": self._board()}]
    return observation

  def step(self, action_text: object):
    result = self.env.step(action_text)
    self.turns.append(
      {
        "reply": action_text,
        "observation": result.observation,
        "reward": result.reward,
        "outcome": result.info.get("outcome"),
        "board": self._board(),
      }
    )
    return result


@dataclasses.dataclass
class _Row:
  """A step's metrics: host scalars, and the update's metrics still on device."""

  step: int
  scalars: dict[str, Any]
  on_device: dict[str, jax.Array]  # full metric names


class _RowLog:
  """Finishes rows: fetches the update metrics, writes the row (when due), moves the bar."""

  def __init__(self, cfg, writer: metrics_lib.MetricsWriter, progress: metrics_lib.Progress):
    self.cfg, self.writer, self.progress = cfg, writer, progress
    self.rows: list[dict[str, Any]] = []
    self.last: dict[str, Any] = {}

  def finish(self, row: _Row) -> int:
    """Writes ``row``; returns its non-finite streak (optimiser steps skipped in a row)."""
    train = self.cfg.train
    scalars = dict(row.scalars)
    scalars.update({k: float(v) for k, v in jax.device_get(row.on_device).items()})
    streak = int(scalars.get("update/nonfinite_streak", 0))
    due = row.step % train.log_every == 0 or row.step == train.num_steps - 1
    if due or streak >= train.max_nonfinite_steps or "eval/" in "".join(scalars):
      self.writer.write(row.step, scalars)
      self.rows.append({"step": row.step, **scalars})
    self.progress.update(row.step + 1, scalars)
    self.last = scalars
    return streak


class NonFiniteError(RuntimeError):
  """Training stopped: too many optimiser steps in a row had non-finite gradients."""


def _say_stopping(signum: int) -> None:
  again = " (Ctrl-C again: quit now)" if signum == signal.SIGINT else ""
  print(f"\n{signal.Signals(signum).name}: stopping after this step, once it is saved{again}")


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
  """Builds a Trainer for ``cfg`` and trains: the one-call form notebooks use
  (``launch/train.py`` builds the Trainer itself, to print the model it built)."""
  return Trainer(cfg, workdir, allow_config_change=allow_config_change).run()
