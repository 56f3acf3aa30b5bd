"""The parallelism selector: a StagePlan per (stage, load, length bucket), never one that OOMs.

Data flow: before each stage call the loop asks ``Selector.choose(stage, load=, bucket=)``; the
chosen plan goes to the executable cache (compiled program of that plan and bucket) and the
dispatcher (moves the batch into the plan's layout). EARL (arXiv 2510.05943) did this for the
rollout only; here it runs for rollout, reference and update.

Candidates are every factorisation of the devices into data x fsdp x tensor that passes
``validate_for_model`` (rollout and reference treat fsdp as data parallelism, so only fsdp=1 is
listed for them), times micro-batch sizes (rollout/reference: the loop runs the load in waves of
``micro_batch_size`` sequences; update: gradient accumulation) and, for the update, remat.
Feasibility: the analytic memory model (``memory_model``) against the per-device budget, then,
before first use of each program shape, the compiled program's ``memory_analysis``
(``compiled_memory`` callback; a longer sequence in the same bucket is a new program and is checked
again), then at run time RESOURCE_EXHAUSTED (the loop, or ``run_with_recovery``, marks the plan
infeasible and re-plans).
When the model rules out every plan and compile checks are on, the plans it predicts smallest are
compiled (up to ``MAX_PROBES``) and the compiled peak decides.
Choice: measured throughput from the profiling table (EARL's method; kept as JSON in the workdir
and reloaded on restart) where there is one, else the analytic cost model. Hysteresis: the current
plan of a stage is kept while it is feasible and the best alternative is not more than
``hysteresis`` (a fraction) faster, so a length hovering at a bucket boundary does not flap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from earl_jax.model.config import ModelConfig
from earl_jax.parallel import memory_model as mm
from earl_jax.parallel.plan import ShardingError, StagePlan, make_stage_plan, validate_for_model
from earl_jax.types import ConfigError, Stage

log = logging.getLogger(__name__)


# Plans compiled past the memory model's verdict, per (stage, bucket, load), before giving up.
MAX_PROBES = 3


class NoFeasiblePlanError(RuntimeError):
  """No candidate plan fits the stage, load and bucket (the message lists every rejection)."""


def bucket_for(length: int, min_bucket: int = 256) -> int:
  """The power-of-two length bucket holding ``length`` (at least ``min_bucket``)."""
  if length < 1 or min_bucket < 1:
    raise ValueError(
      f"bucket_for needs length >= 1 and min_bucket >= 1, got {length}, {min_bucket}"
    )
  return max(1 << (length - 1).bit_length(), 1 << (min_bucket - 1).bit_length())


def is_resource_exhausted(error: BaseException) -> bool:
  """True for an XLA out-of-memory error (JaxRuntimeError / XlaRuntimeError RESOURCE_EXHAUSTED)."""
  names = {c.__name__ for c in type(error).__mro__}
  return bool(names & {"JaxRuntimeError", "XlaRuntimeError"}) and "RESOURCE_EXHAUSTED" in str(error)


def _factorisations(n: int) -> list[tuple[int, int, int]]:
  divs = [d for d in range(1, n + 1) if n % d == 0]
  return [(d, f, n // (d * f)) for d in divs for f in divs if (n // d) % f == 0]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One ranked alternative of a decision."""

  plan: StagePlan
  predicted_bytes: int
  throughput: float  # tokens / s
  source: str  # "measured" | "predicted"
  spread: tuple[float, float] = (0.0, 0.0)  # min/max measured throughput over repeats

  def to_dict(self) -> dict[str, Any]:
    return {
      "plan": self.plan.describe(),
      "predicted_bytes": self.predicted_bytes,
      "throughput": self.throughput,
      "source": self.source,
    }


@dataclasses.dataclass(frozen=True)
class Decision:
  """The selector's answer for one (stage, load, bucket), with everything it weighed."""

  stage: Stage
  bucket: int
  load: int
  plan: StagePlan
  predicted_bytes: int
  throughput: float
  source: str
  reason: str
  alternatives: tuple[Candidate, ...]  # feasible ones, best first
  rejected: tuple[tuple[str, str], ...]  # (plan, why)
  budget_bytes: int
  compiled_bytes: int | None = None

  def to_event(self) -> dict[str, Any]:
    """Payload for ``MetricsWriter.write_event(step, "selector_decision", ...)``."""
    return {
      "stage": self.stage.value,
      "bucket": self.bucket,
      "load": self.load,
      "plan": self.plan.describe(),
      "predicted_bytes": self.predicted_bytes,
      "compiled_bytes": self.compiled_bytes,
      "budget_bytes": self.budget_bytes,
      "throughput": self.throughput,
      "throughput_source": self.source,
      "reason": self.reason,
      "alternatives": [c.to_dict() for c in self.alternatives[1:]],
      "rejected": [list(r) for r in self.rejected],
    }


def memory_budget_from_devices(devices: Sequence[Any]) -> int | None:
  """The smallest ``memory_stats()['bytes_limit']`` of the devices, or None if unavailable."""
  limits = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
      return None
    limits.append(int(stats["bytes_limit"]))
  return min(limits) if limits else None


class Selector:
  """Chooses StagePlans; see the module docstring. Not thread-safe (one per training loop)."""

  def __init__(
    self,
    model_cfg: ModelConfig,
    devices: Sequence[Any],
    *,
    memory_budget_bytes: int | None = None,
    profile_path: str | None = None,
    hysteresis: float = 0.1,
    device_spec: mm.DeviceSpec = mm.DEFAULT_SPEC,
    micro_batch_splits: Sequence[int] | None = None,
    remat_options: Sequence[str] = ("none", "full"),
    prompt_chunk: int = 16,
    new_tokens: int = 8,
    logits_chunk: int = 128,
    metrics: Any = None,
  ) -> None:
    if not devices:
      raise ConfigError("devices", devices, "a non-empty list of devices")
    if hysteresis < 0:
      raise ConfigError("hysteresis", hysteresis, "a fraction >= 0")
    self.cfg, self.device_ids = model_cfg, tuple(int(d.id) for d in devices)
    from_devices = memory_budget_from_devices(devices)
    if memory_budget_bytes is None:
      if from_devices is None:
        raise ConfigError(
          "memory_budget_bytes",
          None,
          "bytes per device: this backend's device.memory_stats() has no 'bytes_limit'",
        )
      self.budget, origin = from_devices, "device.memory_stats()['bytes_limit']"
    else:
      if memory_budget_bytes < 1:
        raise ConfigError("memory_budget_bytes", memory_budget_bytes, "a positive int")
      self.budget, origin = int(memory_budget_bytes), "config (simulated limit)"
    log.info("selector: memory budget %.3f GiB per device from %s", self.budget / 2**30, origin)
    self.hysteresis, self.spec, self.metrics = hysteresis, device_spec, metrics
    self.splits = None if micro_batch_splits is None else tuple(micro_batch_splits)
    self.remats = tuple(remat_options)
    self.shape = {"prompt_chunk": prompt_chunk, "new_tokens": new_tokens}
    self.shape["logits_chunk"] = logits_chunk
    self.profile_path = profile_path
    self.table: dict[str, dict[str, Any]] = {}
    if profile_path and os.path.exists(profile_path):
      with open(profile_path) as f:
        self.table = json.load(f)
      log.info("selector: loaded %d profiled entries from %s", len(self.table), profile_path)
    self._infeasible: dict[tuple[Stage, int, StagePlan], tuple[int, str]] = {}
    # Compiled peaks by (stage, bucket, load, plan, program shape): a longer T in a bucket is
    # another program, with its own peak.
    self._compiled: dict[tuple[Stage, int, int, StagePlan, Hashable], int] = {}
    self._probes: dict[
      tuple[Stage, int, int, Hashable], int
    ] = {}  # compiles past the model, see _probe
    self._current: dict[Stage, StagePlan] = {}

  # -- candidates ---------------------------------------------------------------------------

  def candidates(self, stage: Stage, load: int) -> tuple[list[StagePlan], list[tuple[str, str]]]:
    """All plans for ``stage`` and ``load`` that pass validation, and (plan, why) rejections."""
    plans, rejected = [], []
    for d, f, t in _factorisations(len(self.device_ids)):
      if f > 1 and stage != Stage.UPDATE:
        continue  # rollout/reference rules map fsdp to batch only: same as data
      # Default splits: every power of two dividing the load (waves of load / split sequences).
      splits = self.splits or [1 << i for i in range(load.bit_length()) if load % (1 << i) == 0]
      for split in splits:
        if load % split:
          continue
        mb = 0 if split == 1 else load // split
        for remat in self.remats if stage == Stage.UPDATE else ("none",):
          plan = make_stage_plan(stage, self.device_ids, d, f, t, micro_batch_size=mb, remat=remat)
          try:
            validate_for_model(plan, self.cfg, batch_size=mb or load)
          except ShardingError as e:
            rejected.append((plan.describe(), str(e)))
            continue
          plans.append(plan)
    return plans, rejected

  def _workload(self, stage: Stage, load: int, bucket: int, plan: StagePlan) -> mm.Workload:
    # Rollout/reference run the load in waves of micro_batch_size; the update accumulates.
    wave = plan.micro_batch_size if plan.micro_batch_size and stage != Stage.UPDATE else load
    return mm.Workload(stage, wave, bucket, **self.shape)

  def predict(self, stage: Stage, load: int, bucket: int, plan: StagePlan) -> tuple[int, float]:
    """(predicted peak bytes per device, predicted tokens/s for the whole load) of ``plan``."""
    w = self._workload(stage, load, bucket, plan)
    seconds = mm.estimate_seconds(self.cfg, plan, w, self.spec) * (load // w.load)
    tokens = load * (w.new_tokens if stage == Stage.ROLLOUT else bucket)
    return mm.estimate_memory(self.cfg, plan, w, self.spec).total, tokens / seconds

  @staticmethod
  def _key(stage: Stage, bucket: int, load: int, plan: StagePlan) -> str:
    return f"{stage.value}|{bucket}|{load}|{plan.describe()}"

  def _state_too_big(self, stage: Stage, load: int, bucket: int, plan: StagePlan) -> str:
    """Why ``plan`` cannot fit whatever the compiler does: its parameters (and optimiser state)
    alone, sizes the model knows exactly, exceed the budget; else ""."""
    m = mm.estimate_memory(self.cfg, plan, self._workload(stage, load, bucket, plan), self.spec)
    state = m.weights + m.optimizer
    if state <= self.budget:
      return ""
    return f"parameters and optimiser state {state} B > budget {self.budget} B"

  def _infeasible_reason(self, stage: Stage, bucket: int, load: int, plan: StagePlan) -> str:
    hit = self._infeasible.get((stage, bucket, plan))
    return hit[1] if hit is not None and load >= hit[0] else ""

  # -- choice -------------------------------------------------------------------------------

  def ranked(
    self,
    stage: Stage,
    *,
    load: int,
    bucket: int,
    will_compile: bool = False,
    shape: Hashable = None,
  ) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Feasible candidates best first (measured before predicted), and the rejected ones.

    A compiled peak, once known for the program ``shape``, overrides the prediction. With
    ``will_compile`` (the caller checks memory_analysis before first use) a plan is only dropped
    unseen when even the model's largest over-prediction (``MEMORY_TOLERANCE``) cannot bring it
    under the budget.
    """
    plans, rejected = self.candidates(stage, load)
    slack = mm.MEMORY_TOLERANCE[1] if will_compile else 1.0
    feasible = []
    for plan in plans:
      nbytes, predicted = self.predict(stage, load, bucket, plan)
      why = self._infeasible_reason(stage, bucket, load, plan) or self._state_too_big(
        stage, load, bucket, plan
      )
      compiled = self._compiled.get((stage, bucket, load, plan, shape))
      if not why and compiled is not None and compiled > self.budget:
        why = f"compiled peak {compiled} B > budget {self.budget} B"
      if not why and compiled is None and nbytes > self.budget * slack:
        why = f"predicted {nbytes} B > budget {self.budget} B" + (
          " x slack" if will_compile else ""
        )
      if why:
        rejected.append((plan.describe(), why))
        continue
      row = self.table.get(self._key(stage, bucket, load, plan))
      if row is not None:
        spread = (row["min"], row["max"])
        feasible.append(Candidate(plan, nbytes, row["throughput"], "measured", spread))
      else:
        feasible.append(Candidate(plan, nbytes, predicted, "predicted"))
    feasible.sort(key=lambda c: (c.source != "measured", -c.throughput))
    return feasible, rejected

  def choose(
    self,
    stage: Stage,
    *,
    load: int,
    bucket: int,
    compiled_memory: Callable[[StagePlan], Any] | None = None,
    step: int = 0,
    shape: Hashable = None,
  ) -> Decision:
    """The plan for ``stage`` at ``load`` sequences and length ``bucket``.

    ``compiled_memory(plan)`` (optional) returns the compiled program's MemoryStats (anything with
    ``.peak``); it is called before a plan's first use for each program ``shape`` (what, besides
    the plan, load and bucket, sets the compiled program: the exact sequence length, the cache
    length), and a plan whose compiled peak exceeds the budget is rejected and the next one tried.
    """
    while True:
      will_compile = compiled_memory is not None
      feasible, rejected = self.ranked(
        stage, load=load, bucket=bucket, will_compile=will_compile, shape=shape
      )
      if not feasible and will_compile and self._probe(stage, load, bucket, compiled_memory, shape):
        continue  # ranked() now knows that plan's compiled peak
      if not feasible:
        lines = "\n  ".join(f"{p}: {why}" for p, why in rejected)
        raise NoFeasiblePlanError(
          f"no plan fits {stage.value} at load={load}, bucket={bucket} with "
          f"{self.budget} B per device; rejected:\n  {lines}"
        )
      best, reason = feasible[0], f"best {feasible[0].source} throughput"
      current = self._current.get(stage)
      kept = next((c for c in feasible if c.plan == current), None)
      close = kept is not None and best.throughput <= kept.throughput * (1 + self.hysteresis)
      if close and kept is not best and best.source == kept.source:
        reason = f"hysteresis: best is within {self.hysteresis:.0%} of the current plan"
        best = kept
      key = (stage, bucket, load, best.plan, shape)
      if compiled_memory is not None and key not in self._compiled:
        self._compiled[key] = int(compiled_memory(best.plan).peak)
        if self._compiled[key] > self.budget:
          continue  # ranked() now rejects it
      break
    alternatives = (best, *[c for c in feasible if c is not best])
    decision = Decision(
      stage, bucket, load, best.plan, best.predicted_bytes, best.throughput, best.source,
      reason, alternatives, tuple(rejected), self.budget, self._compiled.get(key),
    )  # fmt: skip
    self._current[stage] = best.plan
    log.info(
      "selector: %s load=%d bucket=%d -> %s (%s, %.3g tok/s, %d B predicted)",
      stage.value, load, bucket, best.plan.describe(), reason, best.throughput,
      best.predicted_bytes,
    )  # fmt: skip
    if self.metrics is not None:
      self.metrics.write_event(step, "selector_decision", decision.to_event())
    return decision

  def _probe(
    self,
    stage: Stage,
    load: int,
    bucket: int,
    compiled_memory: Callable[[StagePlan], Any],
    shape: Hashable = None,
  ) -> bool:
    """When the memory model rules out every plan, the compiler decides: the plan with the
    smallest predicted peak that was not compiled yet is compiled and its peak recorded (ranked()
    keeps it if it fits). At most MAX_PROBES per (stage, bucket, load, program shape); returns
    whether it probed. The model over-predicts most where fixed overheads dominate (small models,
    tight budgets)."""
    where = (stage, bucket, load)
    if self._probes.get((*where, shape), 0) >= MAX_PROBES:
      return False
    unseen = [
      p
      for p in self.candidates(stage, load)[0]
      if (*where, p, shape) not in self._compiled
      and not self._infeasible_reason(stage, bucket, load, p)
      and not self._state_too_big(stage, load, bucket, p)
    ]
    if not unseen:
      return False
    plan = min(unseen, key=lambda p: self.predict(stage, load, bucket, p)[0])
    self._probes[(*where, shape)] = self._probes.get((*where, shape), 0) + 1
    self._compiled[(*where, plan, shape)] = peak = int(compiled_memory(plan).peak)
    log.warning(
      "selector: the memory model rules out every %s plan at load=%d bucket=%d; compiled %s "
      "instead: peak %d B, budget %d B", stage.value, load, bucket, plan.describe(), peak,
      self.budget,
    )  # fmt: skip
    return True

  def mark_infeasible(
    self, stage: Stage, bucket: int, plan: StagePlan, *, load: int = 0, reason: str = ""
  ) -> None:
    """Never choose ``plan`` again for ``bucket`` at ``load`` sequences or more."""
    key = (stage, bucket, plan)
    old = self._infeasible.get(key)
    if old is None or load < old[0]:
      self._infeasible[key] = (load, reason or "marked infeasible (ran out of memory)")
    if self._current.get(stage) == plan:
      del self._current[stage]
    log.warning(
      "selector: %s marked infeasible for bucket %d, load >= %d: %s",
      plan.describe(), bucket, load, self._infeasible[key][1],
    )  # fmt: skip

  # -- profiling and recovery ---------------------------------------------------------------

  def profile(
    self,
    stage: Stage,
    bucket: int,
    candidates: Sequence[StagePlan] | None,
    run_fn: Callable[[StagePlan], Any],
    *,
    load: int,
    repeats: int = 3,
  ) -> dict[str, float]:
    """Times ``run_fn(plan)`` (one stage call on real data) for each plan; saves the table.

    The first call per plan is a warm-up (compilation); then the plans take turns for
    ``repeats`` rounds, so a burst of load from other processes hits all of them alike.
    Throughput = tokens of the call / median time. A plan that runs out of memory is marked
    infeasible.
    """
    if candidates is None:
      candidates = [c.plan for c in self.ranked(stage, load=load, bucket=bucket)[0]]
    tokens = load * (self.shape["new_tokens"] if stage == Stage.ROLLOUT else bucket)
    times: dict[StagePlan, list[float]] = {}
    for round_ in range(repeats + 1):  # round 0 is the warm-up
      for plan in candidates if round_ == 0 else list(times):
        try:
          start = time.perf_counter()
          run_fn(plan)
          elapsed = time.perf_counter() - start
        except Exception as e:
          if not is_resource_exhausted(e):
            raise
          self.mark_infeasible(stage, bucket, plan, load=load, reason=f"OOM profiling: {e}")
          times.pop(plan, None)
          continue
        times.setdefault(plan, []).extend([elapsed] if round_ else [])
    out = {}
    for plan, ts in times.items():
      row = {"throughput": tokens / statistics.median(ts), "min": tokens / max(ts)}
      row["max"] = tokens / min(ts)
      self.table[self._key(stage, bucket, load, plan)] = row
      out[plan.describe()] = row["throughput"]
    self.save_profile()
    return out

  def save_profile(self) -> None:
    if not self.profile_path:
      return
    os.makedirs(os.path.dirname(os.path.abspath(self.profile_path)), exist_ok=True)
    tmp = self.profile_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.table, f, indent=1, sort_keys=True)
    os.replace(tmp, self.profile_path)  # atomic: a crash never leaves half a table

  def run_with_recovery(
    self,
    stage: Stage,
    bucket: int,
    run_fn: Callable[[StagePlan], Any],
    *,
    load: int,
    step: int = 0,
    compiled_memory: Callable[[StagePlan], Any] | None = None,
    shape: Hashable = None,
  ) -> tuple[Any, Decision]:
    """Runs the stage with the chosen plan; on RESOURCE_EXHAUSTED marks it and retries the next.

    Raises NoFeasiblePlanError when every plan has failed (nothing is silently skipped).
    """
    while True:
      decision = self.choose(
        stage, load=load, bucket=bucket, compiled_memory=compiled_memory, step=step, shape=shape
      )
      try:
        return run_fn(decision.plan), decision
      except Exception as e:
        if not is_resource_exhausted(e):
          raise
        self.mark_infeasible(stage, bucket, decision.plan, load=load, reason=f"OOM at run: {e}")


if __name__ == "__main__":  # the planning CLI lives in plan_cli.py; this is its documented name
  from earl_jax.parallel import plan_cli

  raise SystemExit(plan_cli.main())
