"""Tests of launch/plot.py on a synthetic run directory: which PNGs appear, CLI output, errors."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

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
      row |= {"time/rollout": 1.0 + 0.1 * step, "time/update": 0.5}
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
