"""Tests of launch/plot.py on a synthetic run directory: which PNGs appear, CLI output, errors."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# launch/ is a folder of scripts, not a package: load the script by path under a unique name.
_SPEC = importlib.util.spec_from_file_location("earl_launch_plot", _REPO / "launch" / "plot.py")
plot_lib = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(plot_lib)


def _write_run(workdir: pathlib.Path, *, full: bool) -> None:
  """A fake run: rewards every step, eval every 2 steps, stage times, selector decisions."""
  workdir.mkdir(parents=True, exist_ok=True)
  rows = []
  for step in range(1, 7):
    row = {"step": step, "time": 1000.0 + step, "reward/mean": 0.1 * step, "loss": 1.0 / step}
    if full:
      row |= {"context_len/mean": 50.0 + step, "context_len/max": 90 + step}
      row |= {"time/rollout": 1.0 + 0.1 * step, "time/update": 0.5, "time/step": 1.5 + 0.1 * step}
      row |= {"reward/std": 0.5, "win_rate": 0.1 * step, "compilations": 3 if step < 4 else 4}
      if step % 2 == 0:
        row |= {"eval/random/win_rate": 0.2 * step / 2, "eval/mcts/win_rate": 0.1, "time/eval": 2.0}
    rows.append(row)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  if full:
    events = [
      {"step": 1, "time": 1.0, "kind": "selector_decision", "stage": "rollout", "bucket": 128,
       "plan": "data=8"},
      {"step": 1, "time": 1.0, "kind": "selector_decision", "stage": "update", "bucket": 128,
       "plan": "fsdp=4,tensor=2"},
      {"step": 4, "time": 4.0, "kind": "selector_decision", "stage": "rollout", "bucket": 256,
       "plan": "data=4,tensor=2"},
      {"step": 4, "time": 4.0, "kind": "plan_change", "what": "ignored by the plots"},
      {"step": 1, "time": 0.5, "kind": "baselines", "specs": ["column", "heuristic"],
       "episodes": 8, "seconds": 0.1,
       "win_rate": {"column": {"random": 0.7, "mcts": 0.0}, "heuristic": {"random": 0.98,
                    "mcts": 0.3}}},
    ]  # fmt: skip
    (workdir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _assert_pngs(paths: list[pathlib.Path], names: set[str]) -> None:
  assert {p.name for p in paths} == names
  for p in paths:
    assert p.read_bytes()[:8] == _PNG_MAGIC and p.stat().st_size > 5000


def test_all_plots_written_when_keys_exist(tmp_path):
  _write_run(tmp_path, full=True)
  paths = plot_lib.plot_workdir(tmp_path)
  _assert_pngs(
    paths,
    {
      "reward.png",
      "eval_win_rate.png",
      "context_length.png",
      "stage_times.png",
      "selector_decisions.png",
    },
  )
  assert all(p.parent == tmp_path / "plots" for p in paths)


def test_only_plots_whose_keys_exist(tmp_path):
  _write_run(tmp_path, full=False)
  _assert_pngs(plot_lib.plot_workdir(tmp_path, tmp_path / "elsewhere"), {"reward.png"})
  assert not (tmp_path / "plots").exists()


def test_selector_events_without_fields_raise(tmp_path):
  _write_run(tmp_path, full=False)
  (tmp_path / "events.jsonl").write_text('{"step": 1, "kind": "selector_decision"}\n')
  with pytest.raises(ValueError, match="need 'stage' and 'plan'"):
    plot_lib.plot_workdir(tmp_path)


@pytest.mark.slow
def test_cli_prints_paths_and_fails_clearly_without_metrics(tmp_path):
  _write_run(tmp_path / "run", full=True)
  env = dict(os.environ, PYTHONPATH=str(_REPO))
  cmd = [sys.executable, str(_REPO / "launch" / "plot.py"), "--workdir", str(tmp_path / "run")]
  out = tmp_path / "out"
  done = subprocess.run(
    [*cmd, "--out", str(out)], capture_output=True, text=True, env=env, timeout=120
  )
  assert done.returncode == 0, done.stderr
  printed = [pathlib.Path(line) for line in done.stdout.split()]
  assert len(printed) == 5 and all(p.parent == out and p.is_file() for p in printed)
  cmd[-1] = str(tmp_path / "empty")
  failed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
  assert failed.returncode == 1
  assert "no metrics.jsonl in" in failed.stderr and str(tmp_path / "empty") in failed.stderr


def test_stage_times_stack_the_parts_and_leave_compile_steps_out(tmp_path):
  _write_run(tmp_path, full=True)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  keys = ["time/eval", "time/rollout", "time/update"]  # what plot_workdir stacks: not time/step
  steps, seconds, compiled = plot_lib.stage_series(rows, keys)
  # Step 1 starts the run (its programs compiled), step 4 compiled one more (compilations 3->4).
  assert compiled == [1, 4] and list(steps) == [2, 3, 5, 6]
  # The stack's height is the sum of the stages (time/step itself is never stacked on them).
  assert np.allclose(seconds.sum(0), [1.2 + 0.5 + 2.0, 1.3 + 0.5, 1.5 + 0.5, 1.6 + 0.5 + 2.0])


def test_baselines_become_reference_lines_per_opponent(tmp_path):
  _write_run(tmp_path, full=True)
  from earl_jax import metrics as metrics_lib

  lines = plot_lib.baseline_lines(metrics_lib.read_events(tmp_path, kind="baselines"))
  assert lines == {
    "random": {"column": 0.7, "heuristic": 0.98},
    "mcts": {"column": 0.0, "heuristic": 0.3},
  }
  assert plot_lib.baseline_lines([]) == {}


def test_smoothing_is_debiased():
  values = np.full(5, 0.8)
  assert np.allclose(plot_lib.smooth(values), 0.8)  # a constant stays put from the first point
  assert plot_lib.smooth(np.asarray([0.0, 1.0]))[1] > 0.5  # debiased: not pulled towards 0
