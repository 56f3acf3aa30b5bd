"""Pod fit check without hardware: will this config fit N devices of M bytes at context T?

  python -m earl_jax.parallel.fit --config=configs/connect_four_qwen2_5_7b.py --devices 8 \
    --device-memory 80GiB --context 2048,8192 [--config.rollout.max_context=32768 ...]

On N simulated CPU devices, for each context and stage (rollout, reference, update), the selector
(budget = --device-memory) picks a plan, that stage's program is lowered from abstract shapes and
compiled (nothing is allocated: a 72B model needs no memory here), and a row gives the plan, the
analytic model's predicted peak per device, the compiled peak per device (XLA's memory analysis)
and whether it fits. ``--plans config`` checks the config's fixed layouts instead. The model's
architecture comes from ``pretrained_path`` (a local checkpoint's config.json, or the preset of a
hub id such as Qwen/Qwen2.5-7B-Instruct), ``--model`` (a preset or a config.json) or the config's
model section; its run-time keys (dtypes, attention) from the config.

Compiled on the CPU backend: attention runs the chunked kernel (``auto`` there), which holds the
memory of the flash kernels a GPU or TPU would run; fusion differs, so treat a row within a few
percent of the budget as a risk, not a fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time
from collections.abc import Sequence
from typing import Any

from earl_jax import config_lib
from earl_jax.parallel import plan_cli, presets
from earl_jax.types import ConfigError, Stage

_GIB = 2**30
# JAX-side modules are imported inside the functions that use them: the simulated device count
# must be set (``_set_up_devices``) before anything starts a JAX backend.


# Extra KV caches XLA:CPU keeps live through a decode loop over scanned layers (measured on
# Qwen2.5-0.5B/7B rollouts at 1-32K: the compiled peak holds the cache three times, the argument
# and two temporaries; unrolled layers, the CPU default memory_model.CPU_SPEC describes, hold one
# temporary). XLA:GPU updates the cache in place.
_CPU_SCANNED_DECODE_CACHE_COPIES = 2


def _fit_spec():
  """The selector's device model for programs compiled by XLA:CPU: accelerator speeds (they rank
  the plans) and XLA:CPU's memory behaviour, so predicted and compiled peaks describe the same
  program; on a GPU the rollout's peak is lower by those cache copies."""
  from earl_jax.parallel import memory_model as mm

  return dataclasses.replace(mm.DEFAULT_SPEC, kv_cache_copies=_CPU_SCANNED_DECODE_CACHE_COPIES)


@dataclasses.dataclass
class FitRow:
  """One stage at one context: the plan checked and its memory per device."""

  context: int
  stage: str
  load: int
  plan: str
  predicted_bytes: int | None
  compiled_bytes: int | None
  budget_bytes: int
  fits: bool
  compile_seconds: float
  note: str = ""

  @property
  def error(self) -> float | None:
    """(predicted - compiled) / compiled: the analytic model's error on this program."""
    if not self.predicted_bytes or not self.compiled_bytes:
      return None
    return (self.predicted_bytes - self.compiled_bytes) / self.compiled_bytes


def model_config(cfg: config_lib.ExperimentConfig, model: str = "") -> Any:
  """The architecture to check (see the module docstring) with the config's run-time keys."""
  from earl_jax.model import hf_import

  source = model
  if not source and cfg.pretrained_path:
    if os.path.isdir(cfg.pretrained_path):
      return hf_import.read_config(cfg.pretrained_path, cfg.model)[0]
    name = cfg.pretrained_path.split("/")[-1].lower()
    source = next((p for p in sorted(presets.PRESETS, key=len, reverse=True) if p in name), "")
    if not source:
      raise ConfigError(
        "pretrained_path",
        cfg.pretrained_path,
        f"a local checkpoint directory or a hub id naming a preset {sorted(presets.PRESETS)}; "
        "or pass --model <preset | config.json>",
      )
  if not source:
    return cfg.model
  arch = presets.resolve_model(source)
  keys = hf_import.ARCHITECTURE_KEYS
  return dataclasses.replace(cfg.model, **{k: getattr(arch, k) for k in keys})


def for_accelerators(model_cfg):
  """The model as a GPU or TPU runs it: "auto" layer loops (the decode loop's and the forward's)
  are scanned there (unrolled only on CPU), so the CPU compile checks the accelerator's program."""
  loops = ("decode_layers", "forward_layers")
  return dataclasses.replace(
    model_cfg, **{k: "scan" for k in loops if getattr(model_cfg, k) == "auto"}
  )


class FitCheck:
  """The stage programs of ``cfg`` on ``devices``, compiled from abstract shapes."""

  def __init__(self, cfg: config_lib.ExperimentConfig, model_cfg, devices, budget: int) -> None:
    import jax
    from flax import nnx

    from earl_jax import model as model_lib
    from earl_jax.parallel import selector as selector_lib
    from earl_jax.rl import preflight, programs, update

    self.cfg, self.model_cfg, self.devices, self.budget = cfg, model_cfg, devices, budget
    optimizer = update.make_optimizer(cfg.optim)
    abstract = nnx.eval_shape(lambda: model_lib.Decoder(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = jax.eval_shape(
      lambda p: update.init_train_state(p, optimizer, jax.random.key(0)), params
    )
    # A restricted-answer run's programs gather its answers' logits (and, under legal_answers,
    # take a per-row mask): the fit check compiles them with stand-in ids, one per answer of the
    # env's alphabet (the real ids need the tokenizer, and do not change shapes or memory).
    self.answer_ids = tuple(range(len(preflight.answer_alphabet(cfg))))
    self.programs = programs.StagePrograms(
      cfg, graphdef, params, state, optimizer, answer_ids=self.answer_ids
    )
    self.selector = selector_lib.Selector(
      model_cfg,
      devices,
      memory_budget_bytes=budget,
      device_spec=_fit_spec(),
      prompt_chunk=cfg.rollout.chunk_multiple,
      new_tokens=cfg.rollout.max_new_tokens,
      logits_chunk=cfg.rl.logp_chunk,
    )
    self.num_params = sum(x.size for x in jax.tree.leaves(params))

  def program(self, stage: Stage, plan, context: int):
    """``stage``'s compiled program on ``plan`` for sequences of ``context`` tokens."""
    from earl_jax.rl import programs, rollout
    from earl_jax.rl import stages as stages_lib
    from earl_jax.sampler import engine

    rc = self.cfg.rollout
    if stage is Stage.ROLLOUT:
      strategy = self.cfg.sampler.make(answer_ids=self.answer_ids)
      spec = engine.GenerationSpec.with_stop_ids(
        (0,), strategy=strategy, max_new_tokens=rc.max_new_tokens, pad_id=0
      )
      bucket = (stages_lib.rollout_slots(self.cfg, plan), rc.chunk_multiple)
      return self.programs.rollout(plan, spec, bucket, stages_lib.cache_length(rc, context))
    t = rollout.round_up(context, rc.seq_multiple)  # the rollout batch's padding
    if stage is Stage.REFERENCE:
      return self.programs.score(plan, (self.cfg.rl.batch_size, t))
    return self.programs.update(plan, programs.abstract_update_batch(self.cfg.rl.batch_size, t))

  def check(self, stage: Stage, context: int, plan=None) -> FitRow:
    """The selector's plan (or ``plan``) for ``stage`` at ``context``, compiled."""
    from earl_jax.parallel import selector as selector_lib
    from earl_jax.rl import stages as stages_lib

    load = stages_lib.selector_load(self.cfg, stage)
    bucket = selector_lib.bucket_for(context, self.cfg.rollout.seq_multiple)
    start = time.perf_counter()
    note, tried = "", []

    def compiled_memory(p):
      memory = self.program(stage, p, context).memory
      tried.append((memory.peak, p))
      return memory

    if plan is None:
      try:
        decision = self.selector.choose(
          stage, load=load, bucket=bucket, compiled_memory=compiled_memory, shape=context
        )
        plan = decision.plan
      except selector_lib.NoFeasiblePlanError as e:
        seconds = time.perf_counter() - start
        return self._no_plan(stage, context, load, str(e), seconds, tried)
    else:
      note = "config layout"
    predicted = self.selector.predict(stage, load, bucket, plan)[0]
    compiled = self.program(stage, plan, context).memory.peak
    seconds = time.perf_counter() - start
    return FitRow(
      context, stage.value, load, plan.describe(), predicted, compiled, self.budget,
      compiled <= self.budget, seconds, note,
    )  # fmt: skip

  def _no_plan(
    self, stage: Stage, context: int, load: int, why: str, seconds: float, tried: list
  ) -> FitRow:
    """The row of a stage no plan fits: the compiled plan that came closest, if any."""
    peak, plan = min(tried, key=lambda x: x[0], default=(None, None))
    note = why.splitlines()[0].split("; rejected")[0]
    if plan is not None:
      note += f" ({len(tried)} compiled; shown: the smallest peak)"
    name = "-" if plan is None else plan.describe()
    return FitRow(context, stage.value, load, name, None, peak, self.budget, False, seconds, note)


def _contexts(text: str, cfg: config_lib.ExperimentConfig, model_cfg) -> list[int]:
  try:
    contexts = [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
  except ValueError:
    raise ConfigError("context", text, "token counts separated by commas, e.g. 2048,8192") from None
  if not contexts or min(contexts) < 1:
    raise ConfigError("context", text, "positive token counts")
  for t in contexts:
    for key, limit in (
      ("rollout.max_context", cfg.rollout.max_context),
      ("model.max_seq_len", model_cfg.max_seq_len),
    ):
      if t > limit:
        raise ConfigError(
          "context", t, f"<= {key} = {limit}; raise it with --config.{key}={t} to check {t}"
        )
  return contexts


def _short(plan: str) -> str:
  """'update[devices 0-7; data=2 fsdp=2 tensor=2; mb=4; remat=full]' -> 'data=2 fsdp=2 ...'"""
  inside = plan[plan.find("[") + 1 : plan.rfind("]")] if "[" in plan else plan
  return " ".join(p.strip() for p in inside.split(";")[1:]) or plan


def _format(rows: Sequence[FitRow], header: str) -> str:
  def gib(b):
    if b is None:
      return "-"
    return f"{b / _GIB:.2f}G" if b >= _GIB / 10 else f"{b / 2**20:.2f}M"

  lines = [
    header,
    f"{'context':>7}  {'stage':9} {'load':>4}  {'plan':44} {'predicted':>9} {'compiled':>9} "
    f"{'error':>6}  {'fits':4} {'secs':>5}",
  ]
  for r in rows:
    err = "-" if r.error is None else f"{r.error:+.0%}"
    lines.append(
      f"{r.context:>7}  {r.stage:9} {r.load:>4}  {_short(r.plan):44} {gib(r.predicted_bytes):>9} "
      f"{gib(r.compiled_bytes):>9} {err:>6}  {'yes' if r.fits else 'NO':4} "
      f"{r.compile_seconds:5.0f}" + (f"  {r.note}" if r.note else "")
    )
  lines.append("predicted / compiled: peak bytes per device (compiled: XLA's memory analysis)")
  return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m earl_jax.parallel.fit", description=__doc__)
  p.add_argument("--config", required=True, help="experiment config file (configs/<x>.py)")
  p.add_argument("--devices", type=int, required=True, help="simulated devices (CPU)")
  p.add_argument("--device-memory", required=True, help="per-device memory, e.g. 80GiB")
  p.add_argument("--context", required=True, help="context lengths, e.g. 2048,8192,32768")
  p.add_argument("--model", default="", help="a preset or config.json (default: see above)")
  p.add_argument("--plans", choices=("selector", "config"), default="selector")
  p.add_argument("--format", choices=("text", "json"), default="text")
  return p


def _set_up_devices(n: int) -> list[Any]:
  """``n`` CPU devices (set before jax starts its backends; reused if it already has them)."""
  import jax

  if n < 1:
    raise ConfigError("devices", n, "a positive number of devices")
  try:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # backends already started (a notebook, a test): use what is there
    pass
  devices = jax.devices("cpu")
  if len(devices) < n:
    raise ConfigError(
      "devices", n, f"at most the {len(devices)} CPU devices this process already started with"
    )
  return devices[:n]


def main(argv: Sequence[str] | None = None) -> int:
  args, rest = _parser().parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.")]
  if bad:
    raise ConfigError("arguments", bad, "--config.<key>=<value> overrides and the flags of --help")
  overrides = [a[len("--config.") :] for a in rest]
  cfg = config_lib.load_config_file(args.config, overrides)
  model_cfg = for_accelerators(model_config(cfg, args.model))
  contexts = _contexts(args.context, cfg, model_cfg)
  budget = plan_cli.parse_bytes(args.device_memory)
  check = FitCheck(cfg, model_cfg, _set_up_devices(args.devices), budget)
  fixed = None
  if args.plans == "config":
    from earl_jax.rl import preflight

    fixed = preflight.make_plans(cfg, check.devices, model_cfg)
  rows = [
    check.check(stage, t, None if fixed is None else fixed[stage])
    for t in contexts
    for stage in Stage
  ]
  header = (
    f"{args.config}: {check.num_params / 1e6:,.1f}M parameters ({model_cfg.param_dtype.value} "
    f"weights, {model_cfg.compute_dtype.value} compute) on {args.devices} simulated devices x "
    f"{budget / _GIB:.2f} GiB, plans: {args.plans}"
  )
  if args.format == "json":
    out = [dataclasses.asdict(r) | {"error": r.error} for r in rows]
    print(json.dumps({"header": header, "rows": out}, indent=1))
  else:
    print(_format(rows, header))
  return 0 if all(r.fits for r in rows) else 1
