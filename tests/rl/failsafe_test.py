"""Fail-safe runs: every fault injected, and what the run does about it.

Config errors, a changed config on resume and a held workdir stop the Trainer before any device
work (``Trainer._build`` is replaced by a tripwire); the end-to-end faults (a damaged newest
checkpoint, a failing checkpoint write, NaN gradients) train the tiny model for a few steps.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax import checkpoint as checkpoint_lib
from earl_jax import config_lib
from earl_jax import metrics as metrics_lib
from earl_jax import workdir as workdir_lib
from earl_jax.rl import loop, objective
from tests.rl.loop_test import tiny_config

REPO = pathlib.Path(__file__).resolve().parents[2]


def _with(cfg: config_lib.ExperimentConfig, **dotted) -> config_lib.ExperimentConfig:
  values = config_lib.to_dict(cfg)
  for key, value in dotted.items():
    *path, last = key.split("__")
    node = values
    for part in path:
      node = node[part]
    node[last] = value
  return config_lib.from_config_dict(values)


class _DeviceWork(Exception):
  pass


@pytest.fixture
def no_device_work(monkeypatch):
  """Trainer construction stops where device work would begin."""

  def tripwire(self):
    raise _DeviceWork

  monkeypatch.setattr(loop.Trainer, "_build", tripwire)


@pytest.mark.parametrize(
  "overrides, key",
  [
    ({"parallel__update_layout__fsdp": 3}, "parallel.update_layout"),
    ({"parallel__rollout_layout__tensor": 16}, "parallel.rollout_layout"),
    ({"parallel__num_devices": 64}, "parallel.num_devices"),
    ({"parallel__update_layout__micro_batch_size": 2}, "parallel.update_layout.micro_batch_size"),
    ({"parallel__rollout_layout__micro_batch_size": 4}, "parallel.rollout_layout.micro_batch_size"),
    ({"rl__mini_batches": 4}, "rl.mini_batches"),
    ({"tokenizer__kind": "hf", "tokenizer__path": "/nonexistent/tok"}, "tokenizer.path"),
    ({"pretrained_path": "/nonexistent/model"}, "pretrained_path"),
    ({"model__vocab_size": 16}, "model.vocab_size"),
  ],
)
def test_config_errors_stop_before_device_work_and_free_the_workdir(
  tmp_path, no_device_work, overrides, key
):
  cfg = _with(tiny_config(), **overrides)
  with pytest.raises(config_lib.ConfigError) as e:
    loop.Trainer(cfg, tmp_path)
  assert e.value.key.startswith(key), e.value
  assert "\n" not in str(e.value)
  workdir_lib.WorkdirLock(tmp_path).acquire().release()  # not left locked


def _checkpoint_with_config(workdir: pathlib.Path, cfg: config_lib.ExperimentConfig) -> None:
  with checkpoint_lib.Checkpointer(workdir / "checkpoints", save_every=1, keep=2) as ckpt:
    meta = {"step": 4, "config": json.loads(json.dumps(config_lib.to_dict(cfg)))}
    ckpt.save(4, state={"x": jnp.zeros(2)}, meta=meta)


def test_a_changed_experiment_on_resume_stops_with_a_diff(tmp_path, no_device_work, caplog):
  cfg = tiny_config()
  _checkpoint_with_config(tmp_path, cfg)
  changed = _with(cfg, optim__learning_rate=3e-4, seed=7)
  with pytest.raises(config_lib.ConfigChangedError) as e:
    loop.Trainer(changed, tmp_path)
  message = str(e.value)
  assert "optim.learning_rate: " in message and "-> 0.0003" in message and "seed: 0 -> 7" in message
  assert "step 4" in message and "--allow_config_change" in message
  with pytest.raises(_DeviceWork):  # allowed: goes on (to the tripwire)
    loop.Trainer(changed, tmp_path, allow_config_change=True)
  # Run-only keys (length, cadences, layouts) may change: accepted and logged.
  longer = _with(cfg, train__num_steps=50, train__eval_every=5, parallel__update_layout__fsdp=4)
  with pytest.raises(_DeviceWork):
    loop.Trainer(longer, tmp_path)
  logged = " ".join(r.getMessage() for r in caplog.records)
  assert "train.num_steps: 2 -> 50" in logged and "parallel.update_layout.fsdp: 2 -> 4" in logged


def test_a_second_trainer_on_a_held_workdir_stops_at_once(tmp_path, no_device_work):
  with workdir_lib.WorkdirLock(tmp_path):
    start = time.perf_counter()
    with pytest.raises(workdir_lib.WorkdirError, match=f"in use by pid {os.getpid()} "):
      loop.Trainer(tiny_config(), tmp_path)
    assert time.perf_counter() - start < 5.0


# ------------------------------------------------------------------------------------------------
# The launcher: one line on stderr, no traceback, no flag help.


def _launch(*args: str, cwd: pathlib.Path = REPO) -> tuple[subprocess.CompletedProcess, float]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  start = time.perf_counter()
  out = subprocess.run(
    [sys.executable, str(REPO / "launch" / "train.py"), *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=cwd,
    timeout=300,
  )
  return out, time.perf_counter() - start


def _one_line_error(out: subprocess.CompletedProcess) -> str:
  assert out.returncode != 0
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("earl_jax: "), out.stderr[-2000:]
  assert "Traceback" not in out.stderr and "--workdir" not in out.stdout
  return lines[0]


@pytest.mark.parametrize(
  "text, expected",
  [
    ("", "defines no get_config()"),
    ("def get_config():\n  raise ValueError('bad base')\n", "get_config() raised ValueError: bad"),
    ("import nonexistent_module_xyz\n", "cannot be imported: ModuleNotFoundError"),
    ("def get_config():\n  return 3\n", "returned a int, not a ConfigDict"),
  ],
)
def test_broken_config_files_are_one_line_errors(tmp_path, text, expected):
  path = tmp_path / "exp.py"
  path.write_text(text)
  out, _ = _launch(f"--config={path}", f"--workdir={tmp_path / 'run'}")
  assert expected in _one_line_error(out)


def test_bad_values_and_a_held_workdir_are_one_line_errors(tmp_path):
  out, _ = _launch("--config.sampler.temperature=inf", f"--workdir={tmp_path / 'a'}")
  assert "'sampler.temperature' has value inf; allowed: a finite float" in _one_line_error(out)
  out, _ = _launch("--config.sampler.strategy=top_p", "--config.sampler.top_p=2.0")
  assert "'sampler.top_p' has value 2.0" in _one_line_error(out)
  with workdir_lib.WorkdirLock(tmp_path / "held"):
    out, seconds = _launch(f"--workdir={tmp_path / 'held'}")
    assert f"in use by pid {os.getpid()}" in _one_line_error(out)
  print(f"second trainer stopped after {seconds:.1f} s (interpreter and imports included)")


# ------------------------------------------------------------------------------------------------
# End to end on the tiny model.


@pytest.mark.slow
def test_damaged_newest_checkpoint_and_failed_write_lose_nothing_else(tmp_path, monkeypatch):
  cfg = tiny_config(num_steps=2, checkpoint_every=1, eval_every=0, keep_checkpoints=2)
  loop.Trainer(cfg, tmp_path).run()
  (tmp_path / "checkpoints" / "1" / "state" / "manifest.ocdbt").unlink()
  # Resumes from step 0 (step 1 moved aside) and trains steps 1..2; then the write of step 3
  # fails: the error surfaces once, with the step and the cause, and step 2 stays restorable.
  original = checkpoint_lib.ocp.StandardCheckpointHandler.async_save
  calls = []

  async def fail_from_step_3(self, directory, *args, **kwargs):
    futures = await original(self, directory, *args, **kwargs)
    calls.append(str(directory))
    if "/3" in str(directory):
      from tests.checkpoint_test import _FailedWrite

      return [*(futures or []), _FailedWrite(directory)]
    return futures

  monkeypatch.setattr(checkpoint_lib.ocp.StandardCheckpointHandler, "async_save", fail_from_step_3)
  trainer = loop.Trainer(_with(cfg, train__num_steps=6), tmp_path)
  with pytest.raises(checkpoint_lib.CheckpointWriteError, match=r"step 3 .*No space left"):
    trainer.run()
  assert (tmp_path / "checkpoints.damaged" / "1").is_dir()
  rows = metrics_lib.read_metrics(tmp_path)
  assert [r["step"] for r in rows][:3] == [0, 1, 2]
  monkeypatch.undo()
  resumed = loop.Trainer(_with(cfg, train__num_steps=4), tmp_path)
  assert resumed.checkpointer.all_steps()[-1] == 2
  resumed.run()
  assert [r["step"] for r in metrics_lib.read_metrics(tmp_path)] == [0, 1, 2, 3]


@pytest.mark.slow
def test_nan_gradients_are_counted_then_stop_the_run_with_the_last_good_state(
  tmp_path, monkeypatch
):
  original = objective.Objective.__call__

  def nan_loss(self, *args, **kwargs):
    loss, metrics = original(self, *args, **kwargs)
    return loss * jnp.nan, metrics

  monkeypatch.setattr(objective.Objective, "__call__", nan_loss)
  cfg = _with(tiny_config(num_steps=10, eval_every=0), train__max_nonfinite_steps=3)
  trainer = loop.Trainer(cfg, tmp_path)
  before = jax.tree.map(np.asarray, trainer.state.params)
  # Step k's metrics are read after step k+1 is dispatched: the streak of 3 (step 2) is seen
  # during step 3, whose state (also skipped) is saved before the run stops with both rows.
  with pytest.raises(loop.NonFiniteError, match=r"last 4 optimiser steps had non-finite"):
    trainer.run()
  rows = metrics_lib.read_metrics(tmp_path)
  assert [r["update/nonfinite_streak"] for r in rows] == [1, 2, 3, 4]
  assert [r["update/skipped_updates"] for r in rows] == [1, 2, 3, 4]
  ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints", save_every=1, keep=2)
  assert ckpt.latest_step() == 3
  ckpt.close()
  # The saved state is the trainer's, whose weights the skipped steps left untouched.
  after = jax.tree.map(np.asarray, trainer.state.params)
  jax.tree.map(np.testing.assert_array_equal, before, after)  # skipped steps changed nothing
