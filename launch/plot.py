r"""Plots of a run's metrics.jsonl / events.jsonl as PNGs (the last step of the metrics data flow).

  python launch/plot.py --workdir W [--out W/plots]

Writes, each only when its keys exist: reward.png (``reward/mean`` and the train win rate,
smoothed over the raw points; ``reward/std`` on its own axis below), eval_win_rate.png (a panel
per ``eval/<opponent>/win_rate``, with the run's baselines as dashed reference lines, from its
``baselines`` event), context_length.png (``context_len/mean``, ``context_len/max``),
stage_times.png (the stages' ``time/*`` stacked, ``time/step`` not, which is their sum; steps
that compiled a program are left out and marked, so the compile spikes do not flatten the rest),
selector_decisions.png (events of kind ``selector_decision`` with fields stage, bucket, plan).
Prints the paths written.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # Headless: no display on training machines or in CI.

import matplotlib.pyplot as plt  # After use(): the backend is fixed on import.
import numpy as np

from earl_jax import metrics as metrics_lib

Rows = list[dict[str, Any]]


def _series(rows: Rows, key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of the rows that carry ``key``, in step order."""
  points = sorted((r["step"], r[key]) for r in rows if key in r and r[key] is not None)
  steps, values = zip(*points) if points else ((), ())
  return np.asarray(steps), np.asarray(values, dtype=np.float64)


def _keys(rows: Rows, keep: Callable[[str], bool]) -> list[str]:
  return sorted({k for r in rows for k in r if k not in ("step", "time") and keep(k)})


def _lines(
  path: pathlib.Path,
  rows: Rows,
  keys: list[str],
  title: str,
  ylabel: str,
) -> pathlib.Path:
  fig, ax = plt.subplots(figsize=(7, 4))
  for key in keys:
    ax.plot(*_series(rows, key), marker=".", label=key)
  ax.set(title=title, xlabel="step", ylabel=ylabel)
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def smooth(values: np.ndarray, weight: float = 0.9) -> np.ndarray:
  """Exponential moving average, debiased like TensorBoard's (the first points are not pulled
  towards 0)."""
  out, avg = np.empty_like(values), 0.0
  for i, v in enumerate(values):
    avg = weight * avg + (1 - weight) * v
    out[i] = avg / (1 - weight ** (i + 1))
  return out


def _smoothed(ax: Any, rows: Rows, key: str, label: str) -> None:
  steps, values = _series(rows, key)
  (raw,) = ax.plot(steps, values, alpha=0.25, linewidth=0.8)
  ax.plot(steps, smooth(values), color=raw.get_color(), label=f"{label} (smoothed)")


def _reward(path: pathlib.Path, rows: Rows, keys: list[str], std: bool) -> pathlib.Path:
  fig, axes = plt.subplots(2 if std else 1, 1, figsize=(7, 6 if std else 4), sharex=True)
  top = axes[0] if std else axes
  for key in keys:
    _smoothed(top, rows, key, key)
  top.set(title="Training reward and win rate (raw behind)", ylabel="reward / rate")
  top.grid(alpha=0.3)
  top.legend(fontsize="small")
  if std:
    _smoothed(axes[1], rows, metrics_lib.REWARD_STD_KEY, metrics_lib.REWARD_STD_KEY)
    axes[1].set(ylabel="reward std (in a batch)", xlabel="step")
    axes[1].grid(alpha=0.3)
  else:
    top.set(xlabel="step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def stage_series(rows: Rows, keys: list[str]) -> tuple[np.ndarray, np.ndarray, list[int]]:
  """(steps, seconds per key x step, steps left out): the rows with stage times, in step order,
  except those whose step compiled a program (``compilations`` rose, or the first row of a run
  segment) — compile time there dwarfs the steady state."""
  timed = sorted((r for r in rows if any(k in r for k in keys)), key=lambda r: r["step"])
  kept, compiled, before = [], [], None
  for r in timed:
    count = r.get("compilations")
    if count is not None and (before is None or count > before):
      compiled.append(r["step"])
    else:
      kept.append(r)
    before = count if count is not None else before
  # A stage not run at some step (e.g. eval) contributes 0 s there.
  seconds_NxT = np.asarray([[float(r.get(k, 0.0)) for r in kept] for k in keys])
  return np.asarray([r["step"] for r in kept]), seconds_NxT, compiled


def _stage_times(path: pathlib.Path, rows: Rows, keys: list[str]) -> pathlib.Path:
  steps, seconds_NxT, compiled = stage_series(rows, keys)
  fig, ax = plt.subplots(figsize=(7, 4))
  if len(steps):
    ax.stackplot(steps, seconds_NxT, labels=[k[len(metrics_lib.TIME_PREFIX) :] for k in keys])
  for i, step in enumerate(compiled):
    label = f"compiled (left out: {len(compiled)} steps)" if i == 0 else None
    ax.axvline(step, color="grey", linestyle=":", linewidth=0.8, label=label)
  # Host time: asynchronous stages show their device time where the host next waits (the rollout).
  ax.set(title="Host wall time per stage and step (stacked)", xlabel="step", ylabel="seconds")
  ax.legend(fontsize="small", loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def baseline_lines(events: Rows) -> dict[str, dict[str, float]]:
  """{opponent: {baseline: win rate}} from the newest ``baselines`` event ({} if none)."""
  if not events:
    return {}
  out: dict[str, dict[str, float]] = {}
  for baseline, row in events[-1]["win_rate"].items():
    for opponent, rate in row.items():
      out.setdefault(opponent, {})[baseline] = float(rate)
  return out


def _eval_win_rate(
  path: pathlib.Path, rows: Rows, keys: list[str], baselines: dict[str, dict[str, float]]
) -> pathlib.Path:
  fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
  styles = ["--", "-.", ":", (0, (5, 1))]
  for ax, key in zip(axes[0], keys):
    suite, rate = key[len(metrics_lib.EVAL_PREFIX) :].rsplit("/", 1)
    ax.plot(*_series(rows, key), marker=".", color="black", label="policy (greedy)")
    for i, (name, value) in enumerate(sorted(baselines.get(suite, {}).items())):
      style = styles[i % len(styles)]
      ax.axhline(value, linestyle=style, color=f"C{i}", label=f"{name} {value:.2f}")
    ylabel = rate.replace("_", " ")
    ax.set(title=f"vs {suite}", xlabel="step", ylabel=ylabel, ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
  fig.suptitle("Eval per suite (dashed: baselines on the same episodes)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def _selector_decisions(path: pathlib.Path, events: Rows) -> pathlib.Path:
  """One row per stage; a point per decision, coloured by plan and labelled with its bucket."""
  stages = sorted({str(e["stage"]) for e in events})
  plans = sorted({str(e["plan"]) for e in events})
  colors = plt.get_cmap("tab10")
  fig, ax = plt.subplots(figsize=(8, 1.5 + 0.8 * len(stages)))
  for i, plan in enumerate(plans):
    mine = [e for e in events if str(e["plan"]) == plan]
    ys = [stages.index(str(e["stage"])) for e in mine]
    ax.scatter([e["step"] for e in mine], ys, color=colors(i % 10), label=plan, s=40)
    for e, y in zip(mine, ys):
      if "bucket" in e:
        ax.annotate(
          str(e["bucket"]),
          (e["step"], y),
          textcoords="offset points",
          xytext=(0, 6),
          ha="center",
          fontsize="x-small",
        )
  ax.set_yticks(range(len(stages)), stages)
  ax.set_ylim(-0.5, len(stages) - 0.5)
  ax.set(title="Selector decisions (label: shape bucket)", xlabel="step")
  ax.legend(title="plan", fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def plot_workdir(
  workdir: str | pathlib.Path, out: str | pathlib.Path | None = None
) -> list[pathlib.Path]:
  """Writes every plot whose keys exist into ``out`` (default ``workdir/plots``); returns paths."""
  rows = metrics_lib.read_metrics(workdir)
  events = metrics_lib.read_events(workdir, kind="selector_decision")
  out = pathlib.Path(workdir) / "plots" if out is None else pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  std = metrics_lib.REWARD_STD_KEY
  reward = _keys(rows, lambda k: k.startswith("reward") and k != std)
  reward += _keys(rows, lambda k: k in (metrics_lib.WIN_RATE_KEY, metrics_lib.CORRECT_RATE_KEY))
  if reward:
    has_std = any(std in r for r in rows)
    written.append(_reward(out / "reward.png", rows, reward, has_std))
  prefix, suffixes = metrics_lib.EVAL_PREFIX, metrics_lib.SUCCESS_SUFFIXES
  win = _keys(rows, lambda k: k.startswith(prefix) and k.endswith(suffixes))
  if win:
    lines = baseline_lines(metrics_lib.read_events(workdir, kind="baselines"))
    written.append(_eval_win_rate(out / "eval_win_rate.png", rows, win, lines))
  present = set(_keys(rows, lambda k: True))
  context = [k for k in (metrics_lib.CONTEXT_MEAN_KEY, metrics_lib.CONTEXT_MAX_KEY) if k in present]
  if context:
    written.append(_lines(out / "context_length.png", rows, context, "Context length", "tokens"))
  # time/step is the sum of the stages: stacking it too would double every bar.
  times = _keys(rows, lambda k: k.startswith(metrics_lib.TIME_PREFIX) and k != "time/step")
  if times:
    written.append(_stage_times(out / "stage_times.png", rows, times))
  if events:
    missing = [e for e in events if "stage" not in e or "plan" not in e]
    if missing:
      raise ValueError(f"selector_decision events need 'stage' and 'plan' fields: {missing[0]}")
    written.append(_selector_decisions(out / "selector_decisions.png", events))
  return written


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="run directory with metrics.jsonl")
  parser.add_argument("--out", default=None, help="output folder (default: WORKDIR/plots)")
  args = parser.parse_args(argv)
  try:
    paths = plot_workdir(args.workdir, args.out)
  except (FileNotFoundError, ValueError) as e:
    print(f"plot.py: error: {e}", file=sys.stderr)
    return 1
  for path in paths:
    print(path)
  if not paths:
    print(f"plot.py: no plottable keys in {args.workdir}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
