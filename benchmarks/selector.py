"""Selector benchmark (issue #6): per-bucket plan choice vs fixed plans on 8 CPU devices, a run
with growing context, and the paper-scale projection of the analytic model.

  (a) sweep context x load for rollout, reference and update. The fixed plans are every mesh with
      the same micro-batch options the selector has (whole batch, or two waves / two accumulated
      micro-batches), all timed in one interleaved pass. Three simulated per-device budgets per
      stage, from the fixed plans' compiled peaks at the largest cell: "loose" (every fixed plan
      fits), "median" (half of them do) and "tight" (only the leanest does). Under each budget the
      selector (its own profiling pass, compiled-memory check) is compared with the best fixed
      plan that fits, both read from the same measurements.
  (b) a rollout whose context grows step by step, under the median budget: total time of the
      adaptive selector (switch costs included) vs each fixed plan (micro-batch options included).
  (c) Qwen2.5-72B rollout on 128 x 80 GB from the analytic model: TP=4 (32 engines) vs TP=8
      (16 engines), each running as many sequences as its memory holds, next to the paper's
      Fig. 3 cells.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.selector [--parts abc]
CPU devices share one RAM, so the memory budget is simulated (a config value, as the selector
logs). Reference/update attention is not chunked (quadratic memory), so their sweep stops at 2K.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from earl_jax import hostmem
from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import executables as ex
from earl_jax.parallel import memory_model as mm
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel import selector as sel
from earl_jax.parallel.plan import ShardingError, StagePlan, make_stage_plan, validate_for_model
from earl_jax.parallel.presets import PRESETS
from earl_jax.rl import programs, reference, update
from earl_jax.sampler import engine
from earl_jax.types import Stage

CFG = ModelConfig(
  vocab_size=2048, embed_dim=64, mlp_dim=256, num_layers=2, num_heads=8, num_kv_heads=8,
  head_dim=8, max_seq_len=8192,
)  # fmt: skip
MESHES = {Stage.ROLLOUT: [(8, 1, 1), (4, 1, 2), (2, 1, 4), (1, 1, 8)]}
MESHES[Stage.REFERENCE] = MESHES[Stage.ROLLOUT]
MESHES[Stage.UPDATE] = [*MESHES[Stage.ROLLOUT], (1, 8, 1)]
SWEEP = {  # (contexts, loads); attention of reference/update is quadratic on 2 CPU cores
  Stage.ROLLOUT: ([256, 2048, 8192], [8, 32]),
  Stage.REFERENCE: ([256, 512, 1024], [8]),
  Stage.UPDATE: ([256, 512], [8]),
}
PROMPT, NEW, CHUNK = 16, 4, 128
SPEC = engine.GenerationSpec(max_new_tokens=NEW)


class Bench:
  """Sharded model states per plan, compiled programs per (plan, bucket), timed stage calls."""

  def __init__(self, repeats: int) -> None:
    self.repeats = repeats
    self.programs = ex.ExecutableCache()
    abstract = nnx.eval_shape(lambda: model_lib.Decoder(CFG, rngs=nnx.Rngs(0)))
    self.graphdef, self.abstract = nnx.split(abstract)
    # Host copies: device_put of a device-0 array reuses its buffer for the device-0 shard, and
    # donating the update's train state would then delete the shared source.
    self.params = jax.device_get(nnx.state(model_lib.Decoder(CFG, rngs=nnx.Rngs(0))))
    self.optimizer = update.make_optimizer(update.OptimConfig())
    self._states: dict[Any, Any] = {}

  def state(self, plan: StagePlan) -> Any:
    key = (plan.device_ids, plan.mesh_shape, plan.rules, plan.stage == Stage.UPDATE)
    if key not in self._states:
      if plan.stage == Stage.UPDATE:
        ts = update.init_train_state(self.params, self.optimizer, jax.random.key(0))
        abstract = jax.eval_shape(lambda: ts)
        sh = ex.train_state_shardings(plan, abstract, self.optimizer)
      else:
        ts, sh = self.params, mesh_lib.state_shardings(self.params, plan)
      self._states[key] = jax.block_until_ready(jax.device_put(ts, sh))
    return key

  def program(self, plan: StagePlan, wave: int, length: int) -> ex.StageProgram:
    if plan.stage == Stage.ROLLOUT:
      lower = lambda: ex.lower_generate(  # noqa: E731
        plan, self.graphdef, self.abstract, length, SPEC, bucket=(wave, PROMPT)
      )
    elif plan.stage == Stage.REFERENCE:
      lower = lambda: programs.lower_score(  # noqa: E731
        plan, self.graphdef, self.abstract, bucket=(wave, length), chunk_size=CHUNK
      )
    else:
      key = self.state(plan)  # outside eval_shape: creating it under a trace stores tracers
      ts = jax.eval_shape(lambda: self._states[key])
      batch = _batch_abstract(wave, length)
      lower = lambda: programs.lower_update(  # noqa: E731
        plan, self.graphdef, ts, batch, loss_fn=_loss(plan.remat), optimizer=self.optimizer
      )
    return self.programs.get(plan.stage, plan, (wave, length), lower)

  def wave(self, plan: StagePlan, load: int) -> int:
    mb = plan.micro_batch_size
    return mb if mb and plan.stage != Stage.UPDATE else load

  def peak(self, plan: StagePlan, load: int, length: int) -> int:
    return self.program(plan, self.wave(plan, load), length).memory.peak

  def run(self, plan: StagePlan, load: int, length: int) -> None:
    """One stage call of ``load`` sequences (in waves of micro_batch_size for rollout/ref)."""
    wave = self.wave(plan, load)
    prog, key = self.program(plan, wave, length), self.state(plan)
    row2 = mesh_lib.batch_sharding(plan, 2)
    for _ in range(load // wave):
      tokens, positions, valid = (jax.device_put(x, row2) for x in _tokens(wave, length))
      if plan.stage == Stage.ROLLOUT:
        kv = model_lib.init_cache(CFG, wave, length)
        kv = jax.device_put(kv, ex.cache_shardings(plan, kv))
        active = jax.device_put(jnp.ones((wave,), bool), mesh_lib.batch_sharding(plan, 1))
        rng = jax.device_put(jax.random.key(0), ex.replicated(plan))
        p = slice(0, PROMPT)
        out = prog(self._states[key], kv, tokens[:, p], valid[:, p], positions[:, p], active, rng)
      elif plan.stage == Stage.REFERENCE:
        out = prog(self._states[key], tokens, positions, valid)
      else:
        adv = jax.device_put(jnp.ones((wave,), jnp.float32), mesh_lib.batch_sharding(plan, 1))
        batch = {"tokens": tokens, "positions": positions, "valid": valid, "adv": adv}
        self._states[key], out = prog(self._states[key], batch)
      jax.block_until_ready(out)

  def timed(
    self, plans: list[StagePlan], load: int, length: int
  ) -> dict[StagePlan, tuple[float, float, float]]:
    """(median, min, max) tokens/s per plan over ``repeats`` rounds. The plans take turns
    within each round, so load from other processes on the shared cores hits all of them."""
    times: dict[StagePlan, list[float]] = {p: [] for p in plans}
    for plan in plans:
      self.run(plan, load, length)  # warm-up: first-call costs stay out of the figures
    for _ in range(self.repeats):
      for plan in plans:
        start = time.perf_counter()
        self.run(plan, load, length)
        times[plan].append(time.perf_counter() - start)
    tokens = load * (NEW if plans and plans[0].stage == Stage.ROLLOUT else length)
    return {
      p: (tokens / statistics.median(t), tokens / max(t), tokens / min(t)) for p, t in times.items()
    }


def _tokens(b: int, t: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  rng = np.random.default_rng(b * 7919 + t)
  tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (b, t)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return tokens, positions, jnp.ones((b, t), bool)


def _batch_abstract(b: int, t: int) -> dict[str, jax.ShapeDtypeStruct]:
  out = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in ("tokens", "positions")}
  out["valid"] = jax.ShapeDtypeStruct((b, t), jnp.bool_)
  out["adv"] = jax.ShapeDtypeStruct((b,), jnp.float32)
  return out


def _loss(remat: str) -> update.LossFn:
  def loss_fn(m: nnx.Module, batch: dict, totals: Any) -> tuple[jax.Array, dict]:
    logps_BxT, _ = reference.token_logps(
      m, batch["tokens"], batch["positions"], batch["valid"], chunk_size=CHUNK, remat=remat
    )
    return -jnp.mean(logps_BxT * batch["adv"][:, None]), {}

  return loss_fn


def _fixed(stage: Stage, load: int) -> list[StagePlan]:
  """Every benchmark mesh, whole batch or two waves (the selector's micro_batch_splits=(1, 2))."""
  out = []
  for m in MESHES[stage]:
    for mb in (0, load // 2):
      plan = make_stage_plan(stage, range(8), *m, micro_batch_size=mb)
      try:
        validate_for_model(plan, CFG, batch_size=mb or load)
      except ShardingError:
        continue
      out.append(plan)
  return out


def _name(plan: StagePlan) -> str:
  return f"{'x'.join(map(str, plan.mesh_shape))}/mb{plan.micro_batch_size}"


BUDGETS = ("loose", "median", "tight")


def budgets(bench: Bench) -> dict[Stage, dict[str, int]]:
  """Per stage: simulated per-device limits from the fixed plans' compiled peaks at the longest
  bucket and largest load (max: all fit; median: half do; min: only the leanest does)."""
  out = {}
  for stage, (lengths, loads) in SWEEP.items():
    peaks = [bench.peak(p, max(loads), max(lengths)) for p in _fixed(stage, max(loads))]
    out[stage] = dict(zip(BUDGETS, (max(peaks), int(statistics.median(peaks)), min(peaks))))
  return out


def _fmt(t: tuple[float, float, float] | None) -> str:
  return "OOM" if t is None else f"{t[0]:9.0f} [{t[1]:.0f}-{t[2]:.0f}]"


def part_a(bench: Bench, selectors: dict[Stage, dict[str, sel.Selector]]) -> None:
  print("\n(a) tokens/s median [min-max] over the interleaved measuring pass and the profiling")
  print("    pass. Per budget: how many fixed plans fit, the best of them, the best of those that")
  print("    run the whole batch at once (the earlier, unfair baseline), the selector's plan.")
  print("    ok: selector max >= best fixed min (never worse than the best fitting fixed plan by")
  print("    more than the spread).")
  for stage, (lengths, loads) in SWEEP.items():
    start, by_budget = time.perf_counter(), selectors[stage]
    limits = ", ".join(f"{n} {s.budget / 2**20:.2f}" for n, s in by_budget.items())
    print(f"\n{stage.value}: budgets MiB/device: {limits}")
    for length in lengths:
      for load in loads:
        fixed = _fixed(stage, load)
        measured = bench.timed(fixed, load, length)
        for name, s in by_budget.items():
          try:
            d = _selector_cell(bench, s, stage, load, length, profile=name == BUDGETS[0])
          except sel.NoFeasiblePlanError:
            d = None  # its analytic model rules out every candidate: reported, not hidden
          if d is not None and d.plan not in measured:
            measured.update(bench.timed([d.plan], load, length))
          cell = {p: _with_profile(s, stage, length, load, p, t) for p, t in measured.items()}
          fits = [p for p in fixed if bench.peak(p, load, length) <= s.budget]
          print(
            f"{length:5d} {load:3d} {name:>6s}: {_budget_line(cell, fits, fixed, d)}", flush=True
          )
    print(f"  ({stage.value}: {time.perf_counter() - start:.0f} s)")


def _budget_line(cell: dict, fits: list, fixed: list, d: sel.Decision | None) -> str:
  def txt(p: StagePlan | None) -> str:
    return "none fits" if p is None else f"{_name(p):>11s} {cell[p][0]:7.0f}"

  best = max(fits, key=lambda p: cell[p][0], default=None)
  # The earlier baseline: fixed plans only ran the whole batch at once.
  whole = [p for p in fits if not p.micro_batch_size]
  whole = max(whole, key=lambda p: cell[p][0], default=None)
  spread = "" if best is None else f" [{cell[best][1]:.0f}-{cell[best][2]:.0f}]"
  head = f"{len(fits):2d}/{len(fixed)} fit | best fixed {txt(best)}{spread} | whole-batch only "
  if d is None:
    verdict = "ok" if best is None else "WORSE"
    return f"{head}{txt(whole)} | selector: no plan (memory model rules all out) {verdict}"
  t = cell[d.plan]
  ok = "ok" if best is None or t[2] >= cell[best][1] else "WORSE"
  return f"{head}{txt(whole)} | selector {_name(d.plan):>11s} {_fmt(t)} {ok}"


def _with_profile(
  s: sel.Selector, stage: Stage, length: int, load: int, plan: StagePlan, t: tuple
) -> tuple[float, float, float]:
  """Widens a plan's [min, max] by its profiling-pass calls: both passes are measurements of
  the same plan in the same cell, and their disagreement is the noise of the shared cores."""
  row = s.table.get(s._key(stage, length, load, plan))
  return t if row is None else (t[0], min(t[1], row["min"]), max(t[2], row["max"]))


def _selector_cell(
  bench: Bench, s: sel.Selector, stage: Stage, load: int, length: int, *, profile: bool
) -> sel.Decision:
  """Profiling pass (EARL's method) over the candidates on the benchmark meshes that the memory
  model does not rule out, each checked against its compiled memory first; then the choice.
  The selectors of one stage share their profile table, so only the first budget profiles."""
  peak = lambda p: bench.program(p, bench.wave(p, load), length).memory  # noqa: E731
  cands = [c.plan for c in s.ranked(stage, load=load, bucket=length, will_compile=True)[0]]
  cands = [p for p in cands if p.mesh_shape in MESHES[stage]]
  fits = []
  for plan in cands:
    if peak(plan).peak > s.budget:
      s.mark_infeasible(stage, length, plan, load=load, reason="compiled peak > budget")
    else:
      fits.append(plan)
  if profile:
    s.profile(stage, length, fits, lambda p: bench.run(p, load, length), load=load, repeats=2)
  return s.choose(stage, load=load, bucket=length, compiled_memory=peak)


def part_b(bench: Bench, selector: sel.Selector, load: int) -> None:
  """A rollout whose context grows like a multi-turn run; every step really runs."""
  schedule = [256] * 3 + [2048] * 3 + [8192] * 3
  print(f"\n(b) rollout, load {load}, context per step {schedule}")
  for plan in _fixed(Stage.ROLLOUT, load):
    if any(bench.peak(plan, load, n) > selector.budget for n in schedule):
      first = next(i for i, n in enumerate(schedule) if bench.peak(plan, load, n) > selector.budget)
      print(f"  fixed {_name(plan)}: OOM at step {first}")
      continue
    start = time.perf_counter()
    for n in schedule:
      bench.run(plan, load, n)
    print(f"  fixed {_name(plan)}: {time.perf_counter() - start:.3f} s")
  start, plans, switches = time.perf_counter(), [], 0.0
  for n in schedule:
    bucket = sel.bucket_for(n)
    peak = lambda p, b=bucket: bench.program(p, bench.wave(p, load), b).memory  # noqa: E731
    d = selector.choose(Stage.ROLLOUT, load=load, bucket=bucket, compiled_memory=peak)
    if plans and d.plan != plans[-1]:  # switching costs: re-lay out the weights
      t0 = time.perf_counter()
      bench._states.pop(bench.state(d.plan))
      bench.state(d.plan)
      switches += time.perf_counter() - t0
    plans.append(d.plan)
    bench.run(d.plan, load, n)
  total = time.perf_counter() - start
  path = " -> ".join(
    f"{'x'.join(map(str, p.mesh_shape))}/mb{p.micro_batch_size}"
    for i, p in enumerate(plans)
    if i == 0 or p != plans[i - 1]
  )
  print(f"  adaptive: {total:.3f} s (of which weight re-layout {switches:.3f} s); plans {path}")


PAPER = {  # earl_paper.md s3, Fig. 3: Speedup%(TP4 -> TP8); None = TP4 OOM
  32768: [-1.5, 4.6, 5.0, 6.5, None],
  16384: [-18.8, -5.0, 3.4, 5.5, 3.1],
  8192: [-24.7, -20.8, -4.4, 6.4, 5.2],
  4096: [-18.0, -25.2, -21.9, -5.9, 5.1],
  2048: [-20.0, -28.6, -26.3, -16.6, -5.5],
  1024: [-21.1, -32.2, -30.7, -29.1, -6.9],
}
RESPONSES = [8, 16, 32, 64, 128]


def _engine_best(t: int, responses: int, context: int, budget: float) -> tuple[float, int, int]:
  """(tokens/s/GPU, concurrent sequences, bytes/GPU) of one TP=t engine serving ``responses``
  sequences: as many as its memory holds run at once and a finished one's slot is refilled
  (continuous batching, as vLLM and this project's rollout do), so throughput is that many."""
  cfg, plan = PRESETS["qwen2.5-72b"], make_stage_plan(Stage.ROLLOUT, range(t), 1, 1, t)
  for concurrent in range(responses, 0, -1):
    w = mm.Workload(Stage.ROLLOUT, concurrent, context, prompt_chunk=1, new_tokens=1)
    nbytes = mm.estimate_memory(cfg, plan, w).total
    if nbytes <= budget:
      return concurrent / mm.estimate_seconds(cfg, plan, w) / t, concurrent, nbytes
  return 0.0, 0, 0


def part_c() -> None:
  budget = 0.9 * 80e9  # 80 GB H100, 90% usable (vLLM's default gpu_memory_utilization)
  print("\n(c) Qwen2.5-72B rollout decode on 128 x H100-80GB, analytic model. Responses are per")
  print("    engine (TP=4: 32 engines, TP=8: 16); an engine whose KV cache cannot hold all of them")
  print("    runs as many as fit (c). Cell: predicted Speedup%(TP4->TP8) [paper] c TP4/TP8.")
  match = total = 0
  errors = []
  print(" ctx   " + "".join(f"{r:>26d}" for r in RESPONSES))
  for context, paper_row in PAPER.items():
    cells = []
    for r, paper in zip(RESPONSES, paper_row):
      (t4, c4, _), (t8, c8, _) = (_engine_best(t, r, context, budget) for t in (4, 8))
      speedup = (t8 - t4) / t4 * 100 if t4 else float("inf")
      match += (speedup > 0) == (paper is None or paper > 0)
      total += 1
      if paper is not None and t4:
        errors.append(abs(speedup - paper))
      ref = "OOM4" if paper is None else f"{paper:+.1f}"
      cells.append(f"{speedup:+6.1f}% [{ref:>5s}] c{c4}/{c8}")
    print(f"{context:6d} " + "".join(f"{c:>26s}" for c in cells))
  print(
    f"  predicted TP choice matches the paper's sign in {match}/{total} cells; mean |predicted -"
  )
  print(f"  paper| = {statistics.mean(errors):.1f} points over the {len(errors)} cells it measured")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--parts", default="abc")
  ap.add_argument("--repeats", type=int, default=2)
  args = ap.parse_args()
  print(hostmem.host_line())
  if "c" in args.parts:
    part_c()
  if not set(args.parts) & set("ab"):
    return
  bench, workdir = Bench(args.repeats), tempfile.mkdtemp(prefix="selector_bench_")

  def make(stage: Stage, budget: int, hysteresis: float = 0.0) -> sel.Selector:
    return sel.Selector(
      CFG,
      jax.devices(),
      memory_budget_bytes=budget,
      hysteresis=hysteresis,
      device_spec=mm.CPU_SPEC,
      micro_batch_splits=(1, 2),
      remat_options=("none",),
      prompt_chunk=PROMPT,
      new_tokens=NEW,
      logits_chunk=CHUNK,
      profile_path=os.path.join(workdir, f"profile_{stage.value}.json"),
    )

  selectors = {}
  for stage, limits in budgets(bench).items():
    selectors[stage] = {name: make(stage, limit) for name, limit in limits.items()}
    shared = selectors[stage][BUDGETS[0]].table
    for s in selectors[stage].values():
      s.table = shared  # one profiling pass per cell, read under every budget
  start = time.perf_counter()
  if "a" in args.parts:
    part_a(bench, selectors)
  if "b" in args.parts:
    # A restart under the median budget: reloads the profile table, hysteresis on.
    again = make(Stage.ROLLOUT, selectors[Stage.ROLLOUT]["median"].budget, hysteresis=0.1)
    for load in SWEEP[Stage.ROLLOUT][1]:
      part_b(bench, again, load)
  print(f"\n{bench.programs.compilations} programs compiled; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
