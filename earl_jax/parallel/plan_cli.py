"""Planning without hardware: ``python -m earl_jax.parallel.selector`` (or ``.plan_cli``).

  python -m earl_jax.parallel.selector --model qwen2.5-72b --devices 128 --device-memory 80GiB \
    --stage rollout --context 32768 --responses 128

prints the plan the selector would choose from the analytic memory and time model, its predicted
per-device memory by part, and the ranked alternatives (``--format json`` for machines).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from earl_jax.parallel import memory_model as mm
from earl_jax.parallel.selector import NoFeasiblePlanError, Selector, bucket_for
from earl_jax.types import ConfigError, Stage

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
  """'80GiB' / '80GB' / '1.5e9' -> bytes."""
  s = text.strip().lower().replace(" ", "")
  num = s.rstrip("kmgtib")
  unit = s[len(num) :]
  try:
    return int(float(num) * _UNITS[unit])
  except (KeyError, ValueError):
    raise ConfigError("device-memory", text, f"a number with a unit in {sorted(_UNITS)}") from None


@dataclasses.dataclass(frozen=True)
class _PlanningDevice:
  """A device id for planning without hardware (no memory_stats: the budget comes from flags)."""

  id: int


def plan_report(selector: Selector, stage: Stage, load: int, context: int) -> dict[str, Any]:
  """The CLI's answer as a dict: chosen plan, its memory breakdown, ranked alternatives."""
  bucket = bucket_for(context, min_bucket=1)
  d = selector.choose(stage, load=load, bucket=bucket)
  w = selector._workload(stage, load, bucket, d.plan)
  return {
    "stage": stage.value,
    "load": load,
    "context": context,
    "bucket": bucket,
    "budget_bytes": selector.budget,
    "plan": d.plan.describe(),
    "predicted_bytes": d.predicted_bytes,
    "memory": mm.estimate_memory(selector.cfg, d.plan, w, selector.spec).to_dict(),
    "throughput": d.throughput,
    "ranked": [c.to_dict() for c in d.alternatives],
    "rejected": [list(r) for r in d.rejected],
  }


def _format_text(report: dict[str, Any]) -> str:
  gib = 2**30
  lines = [
    f"{report['stage']} load={report['load']} context={report['context']} "
    f"(bucket {report['bucket']}), budget {report['budget_bytes'] / gib:.2f} GiB/device",
    f"chosen: {report['plan']}  predicted {report['predicted_bytes'] / gib:.2f} GiB/device, "
    f"{report['throughput']:.4g} tok/s",
    "  " + ", ".join(f"{k}={v / gib:.2f}GiB" for k, v in report["memory"].items()),
    "ranked alternatives:",
  ]
  for i, c in enumerate(report["ranked"]):
    lines.append(
      f"  {i + 1:2d}. {c['plan']:60s} {c['predicted_bytes'] / gib:8.2f} GiB "
      f"{c['throughput']:10.4g} tok/s ({c['source']})"
    )
  lines.append(f"rejected: {len(report['rejected'])}")
  lines += [f"  {p}: {why}" for p, why in report["rejected"]]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  import argparse

  from earl_jax.parallel.presets import resolve_model

  ap = argparse.ArgumentParser(description="Plan a stage layout with the analytic model.")
  ap.add_argument("--model", required=True, help="preset name or path to a HF config.json")
  ap.add_argument("--devices", type=int, required=True)
  ap.add_argument("--device-memory", required=True, help="per device, e.g. 80GiB")
  ap.add_argument("--stage", choices=[s.value for s in Stage], default="rollout")
  ap.add_argument("--context", type=int, required=True, help="context length (tokens)")
  ap.add_argument("--responses", type=int, required=True, help="concurrent sequences / batch")
  ap.add_argument("--new-tokens", type=int, default=8, help="rollout decode steps per call")
  ap.add_argument("--format", choices=["text", "json"], default="text")
  args = ap.parse_args(argv)
  selector = Selector(
    resolve_model(args.model),
    [_PlanningDevice(i) for i in range(args.devices)],
    memory_budget_bytes=parse_bytes(args.device_memory),
    new_tokens=args.new_tokens,
  )
  try:
    report = plan_report(selector, Stage(args.stage), args.responses, args.context)
  except NoFeasiblePlanError as e:
    print(f"error: {e}")
    return 1
  print(json.dumps(report, indent=1) if args.format == "json" else _format_text(report))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
