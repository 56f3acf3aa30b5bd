"""launch/serve.py on a trained workdir, launch/play.py against it, as a person would use them."""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys

import pytest

from earl_jax.rl import loop
from tests.rl.loop_test import REPO, tiny_config


def _play_module():
  spec = importlib.util.spec_from_file_location("earl_play", REPO / "launch" / "play.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_serve_a_workdir_and_play_a_game_against_it(tmp_path):
  cfg = tiny_config(num_steps=1, eval_every=0)
  loop.Trainer(cfg, tmp_path / "run").run()
  _a_workdir_read_onto_a_plan_serves_the_same_replies(tmp_path / "run")
  cmd = [sys.executable, "launch/serve.py", f"--workdir={tmp_path / 'run'}", "--port=0"]
  server = subprocess.Popen(
    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  try:
    first = server.stdout.readline()
    assert first.startswith(f"serving {tmp_path / 'run'} step 0 "), first + server.stderr.read()
    address = re.search(r"on (localhost:\d+)", first).group(1)
    server.stdout.readline()  # the service line

    moves = iter(["7", "x", *[str(c) for c in range(7) for _ in range(6)]])  # two bad inputs first
    said: list[str] = []
    play = _play_module()
    outcome = play.play(
      address, cfg, "connect_four", "first", 0, read=lambda prompt: next(moves), write=said.append
    )
    assert outcome in ("win", "loss", "draw", "invalid")
    text = "\n".join(said)
    assert "'7' is not a legal move here" in text and "'x' is not a legal move here" in text
    assert text.count(".......") >= 6  # the board was drawn
    assert f"policy's result: {outcome}" in text
  finally:
    server.send_signal(signal.SIGINT)
    out, err = server.communicate(timeout=60)
  assert server.returncode == 0, err[-2000:]
  assert "server stopped" in out


def _a_workdir_read_onto_a_plan_serves_the_same_replies(workdir):
  """Engine.from_workdir with a (fsdp 2, tensor 2) plan reads each parameter into its sharding
  and replies as the single-device engine does."""
  from earl_jax.parallel.plan import make_stage_plan
  from earl_jax.serve import engine
  from earl_jax.types import Stage
  from tests.serve.serve_test import PROMPTS, _engine_api_replies

  plan = make_stage_plan(Stage.ROLLOUT, range(4), fsdp=2, tensor=2)
  config = engine.EngineConfig(num_slots=2, max_prefill_length=32, max_decode_length=12)
  one = engine.Engine.from_workdir(str(workdir), config)
  four = engine.Engine.from_workdir(str(workdir), config, plan=plan)
  assert len(four.load_params()["embed"].get_value().sharding.device_set) == 4
  assert _engine_api_replies(four, PROMPTS) == _engine_api_replies(one, PROMPTS)


def test_serve_without_checkpoints_is_one_clear_line(tmp_path):
  done = subprocess.run(
    [sys.executable, "launch/serve.py", f"--workdir={tmp_path}"],
    cwd=REPO, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1] == (
    f"earl_jax: {tmp_path} has no checkpoints/ directory: is it a training workdir?"
  )
