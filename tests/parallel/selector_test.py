"""Selector choices on fake device lists (nothing compiled), fail-closed cases, OOM recovery."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from earl_jax.config_lib import ConfigError
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import plan_cli
from earl_jax.parallel import selector as sel
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.parallel.presets import PRESETS, resolve_model
from earl_jax.types import Stage

GIB = 2**30
TINY = ModelConfig(
  vocab_size=200, embed_dim=64, mlp_dim=192, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16
)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  limit: int | None = None

  def memory_stats(self):
    return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}


def fake(n: int, limit: int | None = None) -> list[FakeDevice]:
  return [FakeDevice(i, limit) for i in range(n)]


@pytest.mark.parametrize(
  "length,min_bucket,want", [(1, 256, 256), (256, 256, 256), (257, 256, 512), (5000, 1, 8192)]
)
def test_bucket_for(length, min_bucket, want):
  assert sel.bucket_for(length, min_bucket) == want


@pytest.mark.parametrize(
  "model,stage,load,bucket,want_tensor,want_mb",
  [
    # 72B on one 8x80GiB node: weights only fit well at tensor=8; 128 x 32K needs waves of 32.
    ("qwen2.5-72b", Stage.ROLLOUT, 8, 1024, 8, 0),
    ("qwen2.5-72b", Stage.ROLLOUT, 128, 32768, 8, 32),
    # Reference has no KV cache: tensor=2 data=4 is the fastest that fits; long batches wave
    # (blockwise attention keeps 64 x 4K within waves of 32 rows).
    ("qwen2.5-72b", Stage.REFERENCE, 8, 1024, 2, 0),
    ("qwen2.5-72b", Stage.REFERENCE, 64, 4096, 2, 32),
  ],
)
def test_choice_table(model, stage, load, bucket, want_tensor, want_mb):
  s = sel.Selector(PRESETS[model], fake(8), memory_budget_bytes=80 * GIB)
  d = s.choose(stage, load=load, bucket=bucket)
  assert (d.plan.axis_sizes["tensor"], d.plan.micro_batch_size) == (want_tensor, want_mb)
  assert d.predicted_bytes <= 80 * GIB and d.source == "predicted"
  assert all(c.predicted_bytes <= 80 * GIB for c in d.alternatives)
  assert [c.throughput for c in d.alternatives] == sorted(
    (c.throughput for c in d.alternatives), reverse=True
  )


def test_fail_closed_when_nothing_fits():
  s = sel.Selector(PRESETS["qwen2.5-72b"], fake(8), memory_budget_bytes=80 * GIB)
  with pytest.raises(
    sel.NoFeasiblePlanError, match=r"parameters and optimiser state \d+ B > budget"
  ):
    s.choose(Stage.UPDATE, load=8, bucket=1024)  # 72B with Adam needs > 1 TB


def test_non_dividing_dimensions_are_rejected_not_replicated():
  s = sel.Selector(PRESETS["qwen2.5-7b"], fake(8), memory_budget_bytes=80 * GIB)
  plans, rejected = s.candidates(Stage.ROLLOUT, load=8)
  assert all(p.axis_sizes["tensor"] != 8 for p in plans)  # 28 heads, 4 kv heads
  assert any("tensor=8" in p and "num_heads" in why for p, why in rejected)
  odd = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB)
  # 3 sequences on 8 devices: data>1 does not divide 3, tensor=8 does not divide 4 kv heads.
  with pytest.raises(sel.NoFeasiblePlanError, match="global batch size has size 3"):
    odd.choose(Stage.REFERENCE, load=3, bucket=256)


def test_memory_budget_from_device_stats_or_required():
  assert sel.Selector(TINY, fake(4, limit=123456)).budget == 123456
  with pytest.raises(ConfigError, match="memory_budget_bytes"):
    sel.Selector(TINY, fake(4))
  assert sel.Selector(TINY, fake(4, limit=5), memory_budget_bytes=10**9).budget == 10**9


def _measured(s: sel.Selector, stage, bucket, load, rows) -> None:
  for plan, tput in rows:
    s.table[s._key(stage, bucket, load, plan)] = {"throughput": tput, "min": tput, "max": tput}


def test_measured_throughput_and_hysteresis():
  s = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB, hysteresis=0.1)
  a = make_stage_plan(Stage.ROLLOUT, range(8), 8, 1, 1)
  b = make_stage_plan(Stage.ROLLOUT, range(8), 2, 1, 4)
  _measured(s, Stage.ROLLOUT, 256, 8, [(a, 100.0), (b, 50.0)])
  _measured(s, Stage.ROLLOUT, 512, 8, [(a, 100.0), (b, 105.0)])
  _measured(s, Stage.ROLLOUT, 1024, 8, [(a, 100.0), (b, 130.0)])
  d = s.choose(Stage.ROLLOUT, load=8, bucket=256)
  assert d.plan == a and d.source == "measured"
  d = s.choose(Stage.ROLLOUT, load=8, bucket=512)  # b is only 5% faster: keep a
  assert d.plan == a and "hysteresis" in d.reason
  assert s.choose(Stage.ROLLOUT, load=8, bucket=1024).plan == b  # 30% faster: switch
  assert s.choose(Stage.ROLLOUT, load=8, bucket=512).plan == b  # and stay


def test_mark_infeasible_and_compiled_memory_check():
  s = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB)
  first = s.choose(Stage.REFERENCE, load=8, bucket=256).plan
  s.mark_infeasible(Stage.REFERENCE, 256, first, load=8)
  second = s.choose(Stage.REFERENCE, load=8, bucket=256)
  assert second.plan != first
  assert any(p == first.describe() for p, _ in second.rejected)

  def rejected_at(load, bucket):
    return {p for p, _ in s.ranked(Stage.REFERENCE, load=load, bucket=bucket)[1]}

  assert first.describe() in rejected_at(16, 256)  # a larger load does not fit either
  assert first.describe() not in rejected_at(8, 512)  # other buckets are not affected

  seen = []

  def compiled(plan):
    seen.append(plan)
    return type("M", (), {"peak": 2 * GIB if len(seen) == 1 else 1000})()

  fresh = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB)
  d = fresh.choose(Stage.REFERENCE, load=8, bucket=256, compiled_memory=compiled)
  assert len(seen) == 2 and d.plan == seen[1] and d.compiled_bytes == 1000
  assert any("compiled peak" in why for _, why in d.rejected)


def test_run_with_recovery_after_resource_exhausted():
  s = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB)
  tried = []

  def run(plan):
    tried.append(plan)
    if len(tried) == 1:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes")
    return "ok"

  out, d = s.run_with_recovery(Stage.ROLLOUT, 1024, run, load=8)
  assert out == "ok" and len(tried) == 2 and d.plan == tried[1] != tried[0]
  with pytest.raises(ValueError, match="other"):  # other errors are not swallowed
    s.run_with_recovery(
      Stage.ROLLOUT, 1024, lambda p: (_ for _ in ()).throw(ValueError("other")), load=8
    )


def test_profile_table_persists_and_oom_while_profiling(tmp_path):
  path = str(tmp_path / "selector_profile.json")
  s = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB, profile_path=path)
  plans = [c.plan for c in s.ranked(Stage.REFERENCE, load=8, bucket=256)[0]][:3]

  def run(plan):
    if plan == plans[0]:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: oom")
    return sum(range(1000 * plan.axis_sizes["tensor"]))

  got = s.profile(Stage.REFERENCE, 256, plans, run, load=8, repeats=2)
  assert sorted(got) == sorted(p.describe() for p in plans[1:])
  again = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB, profile_path=path)
  d = again.choose(Stage.REFERENCE, load=8, bucket=256)
  assert d.source == "measured" and d.plan in plans[1:]


def test_decision_event_goes_to_metrics():
  events = []

  class Writer:
    def write_event(self, step, kind, payload):
      events.append((step, kind, json.loads(json.dumps(payload))))

  s = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB, metrics=Writer())
  s.choose(Stage.UPDATE, load=8, bucket=256, step=7)
  step, kind, payload = events[0]
  assert (step, kind) == (7, "selector_decision")
  for key in ("stage", "bucket", "plan", "predicted_bytes", "throughput", "alternatives"):
    assert key in payload
  assert payload["stage"] == "update" and isinstance(payload["plan"], str)


def test_cli_json_and_text(capsys, tmp_path):
  argv = ["--model", "qwen2.5-72b", "--devices", "8", "--device-memory", "80GiB"]
  argv += ["--context", "32768", "--responses", "128"]
  assert plan_cli.main([*argv, "--format", "json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert "tensor=8" in report["plan"] and report["predicted_bytes"] <= 80 * GIB
  assert plan_cli.main(argv) == 0
  assert "ranked alternatives" in capsys.readouterr().out
  cfg_path = tmp_path / "config.json"
  cfg_path.write_text(
    json.dumps({
      "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2,
    })
  )  # fmt: skip
  assert resolve_model(str(tmp_path)).embed_dim == 64
  assert plan_cli.parse_bytes("80GiB") == 80 * GIB
  assert plan_cli.parse_bytes("1.5GB") == 1_500_000_000
  with pytest.raises(ConfigError, match="device-memory"):
    plan_cli.parse_bytes("80 parsecs")


def test_compiled_peak_overrides_a_pessimistic_prediction():
  roomy = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB)
  plans, _ = roomy.candidates(Stage.REFERENCE, load=8)
  smallest = min(roomy.predict(Stage.REFERENCE, 8, 1024, p)[0] for p in plans)
  tight = sel.Selector(TINY, fake(8), memory_budget_bytes=int(smallest * 0.9))
  with pytest.raises(sel.NoFeasiblePlanError):  # no compile check: the prediction decides
    tight.choose(Stage.REFERENCE, load=8, bucket=1024)
  small = type("M", (), {"peak": int(smallest * 0.5)})()
  d = tight.choose(Stage.REFERENCE, load=8, bucket=1024, compiled_memory=lambda p: small)
  assert d.predicted_bytes > tight.budget >= d.compiled_bytes


def test_compiler_decides_when_the_model_rules_out_every_plan():
  roomy = sel.Selector(TINY, fake(8), memory_budget_bytes=GIB)
  plans, _ = roomy.candidates(Stage.REFERENCE, load=8)
  predicted = {p: roomy.predict(Stage.REFERENCE, 8, 1024, p)[0] for p in plans}
  leanest = min(predicted, key=predicted.get)
  budget = int(predicted[leanest] / 3)  # beyond the model's over-prediction tolerance
  assert predicted[leanest] > budget * sel.mm.MEMORY_TOLERANCE[1]
  seen = []

  def compiled(peak):
    return lambda plan: seen.append(plan) or type("M", (), {"peak": peak})()

  fits = sel.Selector(TINY, fake(8), memory_budget_bytes=budget)
  d = fits.choose(Stage.REFERENCE, load=8, bucket=1024, compiled_memory=compiled(budget // 2))
  assert seen == [leanest] and d.plan == leanest and d.compiled_bytes == budget // 2
  # Compiled too large as well: a bounded number of probes, then the usual error.
  seen.clear()
  none = sel.Selector(TINY, fake(8), memory_budget_bytes=budget)
  with pytest.raises(sel.NoFeasiblePlanError, match="compiled peak"):
    none.choose(Stage.REFERENCE, load=8, bucket=1024, compiled_memory=compiled(2 * budget))
  assert len(seen) == sel.MAX_PROBES and len(set(seen)) == sel.MAX_PROBES
  ordered = sorted(predicted, key=predicted.get)[: sel.MAX_PROBES]
  assert [predicted[p] for p in seen] == [predicted[p] for p in ordered]
