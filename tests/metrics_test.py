"""Tests of earl_jax.metrics: JSONL round trip, resume truncation, TensorBoard, W&B, timers."""

import io
import json
import pathlib
import struct
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX import record_writer
from tensorboardX.proto import event_pb2

from earl_jax import metrics as metrics_lib


def _tb_scalars(workdir: pathlib.Path) -> list[tuple[str, int, float]]:
  """(tag, step, value) of every scalar in the TFRecord event files, CRCs checked."""
  out = []
  files = sorted((workdir / metrics_lib.TB_DIR).glob("events.out.tfevents.*"))
  assert files, "no TensorBoard event file written"
  for path in files:
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos : pos + 8])
      (len_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
      assert len_crc == record_writer.masked_crc32c(data[pos : pos + 8])
      record = data[pos + 12 : pos + 12 + length]
      (data_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
      assert data_crc == record_writer.masked_crc32c(record)
      pos += 16 + length
      event = event_pb2.Event.FromString(record)
      out.extend((v.tag, event.step, v.simple_value) for v in event.summary.value)
  return out


def test_jsonl_round_trip_and_tensorboard(tmp_path):
  with metrics_lib.MetricsWriter(tmp_path) as writer:
    writer.write(1, {"reward/mean": 0.5, "count": 3, "flag": True})
    writer.write(2, {"reward/mean": np.float32(0.75), "loss": jnp.asarray(2.5), "n": np.int64(7)})
    writer.write_event(2, "selector_decision", {"stage": "rollout", "bucket": 128, "plan": "d8"})
    writer.write_event(3, "plan_change", {"mesh": np.array([4, 2]), "gain": np.float64(1.5)})
  rows = metrics_lib.read_metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[0]["reward/mean"] == 0.5 and rows[0]["count"] == 3 and rows[0]["flag"] == 1
  assert rows[1]["reward/mean"] == 0.75 and rows[1]["loss"] == 2.5 and rows[1]["n"] == 7
  assert isinstance(rows[1]["n"], int) and all(isinstance(r["time"], float) for r in rows)
  events = metrics_lib.read_events(tmp_path)
  assert [e["kind"] for e in events] == ["selector_decision", "plan_change"]
  assert events[1]["mesh"] == [4, 2] and events[1]["gain"] == 1.5
  decision = metrics_lib.read_events(tmp_path, kind="selector_decision")
  assert decision == [events[0]] and decision[0]["plan"] == "d8"
  scalars = _tb_scalars(tmp_path)
  assert ("reward/mean", 1, 0.5) in scalars and ("loss", 2, 2.5) in scalars
  assert ("reward/mean", 2, 0.75) in scalars


def test_each_write_is_flushed_before_close(tmp_path):
  writer = metrics_lib.MetricsWriter(tmp_path, tensorboard=False)
  writer.write(1, {"a": 1.0})
  writer.write_event(1, "k", {"x": 1})
  # A reader sees the lines while the writer is still open (a killed run keeps them).
  assert metrics_lib.read_metrics(tmp_path)[0]["a"] == 1.0
  assert metrics_lib.read_events(tmp_path)[0]["x"] == 1
  writer.close()
  writer.close()  # idempotent


def test_resume_truncates_later_steps_and_torn_lines(tmp_path):
  with metrics_lib.MetricsWriter(tmp_path, tensorboard=False) as writer:
    for step in range(1, 6):
      writer.write(step, {"v": float(step)})
      writer.write_event(step, "e", {"v": step})
  with open(tmp_path / metrics_lib.METRICS_FILE, "a") as f:
    f.write('{"step": 6, "v": 6.0')  # a torn write of a killed run: no newline
  with metrics_lib.MetricsWriter(tmp_path, tensorboard=True, resume_step=3) as writer:
    writer.write(4, {"v": 40.0})
  assert [(r["step"], r["v"]) for r in metrics_lib.read_metrics(tmp_path)] == [
    (1, 1.0),
    (2, 2.0),
    (3, 3.0),
    (4, 40.0),
  ]
  assert [e["step"] for e in metrics_lib.read_events(tmp_path)] == [1, 2, 3]
  # Without resume_step the existing lines are kept (only a torn tail would be dropped).
  with metrics_lib.MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(5, {"v": 50.0})
  assert [r["step"] for r in metrics_lib.read_metrics(tmp_path)] == [1, 2, 3, 4, 5]


def test_bad_values_and_missing_files_raise_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no metrics\.jsonl in"):
    metrics_lib.read_metrics(tmp_path)
  assert metrics_lib.read_events(tmp_path) == []
  with metrics_lib.MetricsWriter(tmp_path, tensorboard=False) as writer:
    with pytest.raises(ValueError, match=r"'vec' must be a number or a 0-d.*shape \(3,\)"):
      writer.write(1, {"vec": jnp.zeros(3)})
    with pytest.raises(ValueError, match="'step' must be a str other than"):
      writer.write(1, {"step": 1})
    with pytest.raises(ValueError, match="reserved"):
      writer.write_event(1, "k", {"kind": "x"})
    with pytest.raises(TypeError, match="'k' payload is not JSON-serialisable"):
      writer.write_event(1, "k", {"x": object()})
  (tmp_path / metrics_lib.METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 2}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON line"):
    metrics_lib.read_metrics(tmp_path)
  with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON line with a 'step'"):
    metrics_lib.MetricsWriter(tmp_path, tensorboard=False, resume_step=1)
  a_file = tmp_path / "f"
  a_file.write_text("")
  with pytest.raises(NotADirectoryError):
    metrics_lib.MetricsWriter(a_file)


def test_wandb_requested_but_missing_raises(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
  with pytest.raises(ImportError, match="wandb_project='proj' is set but wandb is not installed"):
    metrics_lib.MetricsWriter(tmp_path, wandb_project="proj")


def test_wandb_logs_when_installed(tmp_path, monkeypatch):
  calls = []

  class FakeRun:
    def log(self, values, step):
      calls.append(("log", values, step))

    def finish(self):
      calls.append(("finish",))

  def init(**kwargs):
    calls.append(("init", kwargs["project"], kwargs["config"]))
    return FakeRun()

  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
  with metrics_lib.MetricsWriter(tmp_path, tensorboard=False, wandb_project="p", config={"lr": 1}):
    pass
  with metrics_lib.MetricsWriter(tmp_path, tensorboard=False, wandb_project="p") as writer:
    writer.write(3, {"a": np.float32(1.5)})
  assert calls[:2] == [("init", "p", {"lr": 1}), ("finish",)]
  assert calls[2:] == [("init", "p", {}), ("log", {"a": 1.5}, 3), ("finish",)]


def test_stage_timer_accumulates_and_resets():
  now = [0.0]
  timer = metrics_lib.StageTimer(clock=lambda: now[0])
  with timer("rollout"):
    now[0] += 2.0
  with timer("update"):
    now[0] += 0.5
    with timer("inner"):
      now[0] += 0.25
  with timer("rollout"):
    now[0] += 1.0
  assert timer.summary() == {"time/rollout": 3.0, "time/update": 0.75, "time/inner": 0.25}
  with pytest.raises(RuntimeError, match="already being timed"), timer("a"), timer("a"):
    pass
  assert timer.summary(reset=True)["time/rollout"] == 3.0
  assert timer.summary() == {}


def test_progress_shows_only_present_keys():
  text = metrics_lib.format_scalars(
    {
      "reward/mean": 0.25,
      "eval/random/win_rate": 0.5,
      "context_len/mean": 120.4,
      "context_len/max": 300,
      "time/rollout": 1.234,
      "loss": 9.0,
    }
  )
  assert text == "rew 0.250 | win[random] 0.50 | ctx 120/300 | rollout 1.23s"
  assert metrics_lib.format_scalars({"loss": 1.0}) == ""
  out = io.StringIO()
  with metrics_lib.Progress(10, initial=2, file=out, mininterval=0) as bar:
    bar.update(5, {"win_rate": 0.75})
    assert bar.n == 5
  assert "5/10" in out.getvalue() and "win 0.75" in out.getvalue()


def test_lines_are_plain_json(tmp_path):
  with metrics_lib.MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(7, {"x": 1})
  line = (tmp_path / metrics_lib.METRICS_FILE).read_text().splitlines()[0]
  assert set(json.loads(line)) == {"step", "time", "x"}


def test_profile_window_traces_exactly_the_listed_steps(tmp_path):
  window = metrics_lib.ProfileWindow((1, 2), tmp_path / "profile")
  traces = lambda: sorted((tmp_path / "profile").rglob("*.xplane.pb"))  # noqa: E731
  for step in range(4):
    window.begin(step)
    jnp.arange(8.0).sum().block_until_ready()
    window.end(step)
    assert window._tracing == (step == 1)  # steps 1 and 2 form one trace
    assert len(traces()) == (1 if step >= 2 else 0)
  window.close()
  with pytest.raises(ValueError, match="profile steps"):
    metrics_lib.ProfileWindow((-1,), tmp_path)
