"""End-to-end: the training loop on 8 CPU devices, checkpoints and exact resume."""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from earl_jax import config_lib
from earl_jax import metrics as metrics_lib
from earl_jax.env import games
from earl_jax.rl import loop, stages

REPO = pathlib.Path(__file__).resolve().parents[2]
# Wall-clock and compile counters legitimately differ between runs; everything else must not.
_UNSTABLE = ("time/", "tokens_per_second", "rollout/episodes_per_second", "compilations", "seconds")


def tiny_config(**train) -> config_lib.ExperimentConfig:
  sys.path.insert(0, str(REPO))
  try:
    from configs import connect_four_tiny
  finally:
    sys.path.remove(str(REPO))
  c = connect_four_tiny.get_config()
  c.model.embed_dim, c.model.mlp_dim, c.model.num_layers = 32, 64, 1
  c.rollout.num_slots, c.rl.num_groups, c.rl.group_size = 8, 4, 2
  c.rollout.max_turns = 4
  c.train.num_steps, c.train.eval_every, c.train.eval_episodes = 2, 1, 8
  c.train.final_eval_episodes = 0  # the last step's evaluation as long as the others
  # The loop's mechanics, cheaply: one optimiser step a step, one eval suite, no baselines
  # (tests that need them ask for them).
  c.rl.ppo_epochs, c.rl.mini_batches = 1, 1
  c.train.eval_opponents, c.train.baselines = ("random",), ()
  c.parallel.update_layout.fsdp, c.parallel.update_layout.tensor = (
    2,
    2,
  )  # (data 2, fsdp 2, tensor 2)
  for key, value in train.items():
    c.train[key] = value
  return config_lib.from_config_dict(c)


def _stable(rows):
  keep = lambda k: k != "time" and not any(u in k for u in _UNSTABLE)  # noqa: E731
  return [{k: v for k, v in r.items() if keep(k)} for r in rows]


@pytest.mark.slow
def test_two_steps_end_to_end(tmp_path, monkeypatch):
  cfg = tiny_config(
    profile_steps=(1,), num_steps=3, checkpoint_every=100, baselines=("heuristic",),
    final_eval_episodes=20,
  )  # fmt: skip
  trainer = loop.Trainer(cfg, tmp_path)
  assert trainer.plans.describe()
  order, evaluated = [], []
  update, finish = stages.StageResources.update, loop._RowLog.finish
  monkeypatch.setattr(
    stages.StageResources, "update", lambda s, b: order.append("update") or update(s, b)
  )
  play = stages.StageResources.rollout

  def rollout(s, params, episodes, *args, evaluation=False, **kw):
    if evaluation:
      evaluated.append([e.seed for e in episodes])
    return play(s, params, episodes, *args, evaluation=evaluation, **kw)

  monkeypatch.setattr(stages.StageResources, "rollout", rollout)
  monkeypatch.setattr(loop._RowLog, "finish", lambda s, r: order.append(r.step) or finish(s, r))
  rows = trainer.run()
  assert [r["step"] for r in rows] == [0, 1, 2]
  # Compile time per stage program, in the row of the step that compiled it.
  assert all(rows[0][f"compile/{s}_seconds"] > 0 for s in ("rollout", "reference", "update"))
  assert not any(k.startswith("compile/update") for r in rows[1:] for k in r)
  # Step 1's metrics are fetched only after step 2's update is dispatched. Step 0 is a checkpoint
  # step: its row is written before it is saved (a checkpoint never runs ahead of the log).
  assert order == ["update", 0, "update", "update", 1, 2]
  # The last step's evaluation is the longer final one (20 rounded up to whole waves of the 8
  # slots), and it starts with the seeds every earlier evaluation played.
  assert [r["eval/episodes"] for r in rows] == [8, 8, 24]
  assert [len(seeds) for seeds in evaluated] == [8, 8, 24]
  assert evaluated[0] == evaluated[1] == evaluated[2][:8]
  for r in rows:
    assert r["dispatch/bytes_through_host"] == 0 and r["sync/bytes_through_host"] == 0
    assert 0.0 <= r["eval/random/win_rate"] <= 1.0
    assert r["update/skipped_updates"] == 0 and r["context_len/mean"] > 0
  assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoints").is_dir()
  assert len(list((tmp_path / "profile").rglob("*.xplane.pb"))) == 1  # train.profile_steps
  # The baselines were played once, on the eval seeds, and recorded for the plots.
  (event,) = metrics_lib.read_events(tmp_path, kind="baselines")
  assert event["specs"] == ["heuristic"] and event["episodes"] == 8
  assert 0.5 <= event["win_rate"]["heuristic"]["random"] <= 1.0
  # A second run in the same workdir finds the final checkpoint and has nothing left to do; it
  # reads the baselines back instead of playing them again.
  again = loop.Trainer(cfg, tmp_path)
  assert again.baselines()["seconds"] == event["seconds"]
  assert again.run() == []


def _train_subprocess(workdir: pathlib.Path, num_steps: int, checkpoint_every: int, **popen):
  code = (
    f"import sys; sys.path.insert(0, {str(REPO)!r});"
    "from tests.rl.loop_test import tiny_config; from earl_jax.rl import loop;"
    f"cfg = tiny_config(num_steps={num_steps}, checkpoint_every={checkpoint_every}, eval_every=0);"
    f"loop.Trainer(cfg, {str(workdir)!r}).run()"
  )
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, **popen)


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_exits_cleanly(tmp_path):
  proc = _train_subprocess(tmp_path, 200, 1000, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 600
  while not (tmp_path / "checkpoints" / "0").is_dir() and time.time() < deadline:
    assert proc.poll() is None, "the run ended before it could be interrupted"
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=300)
  text = out.decode(errors="replace")
  assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
  assert "SIGINT: stopping after this step" in text and "SIGINT: saved step" in text, text[-3000:]
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert 0 < steps[-1] < 199 and rows[-1]["step"] == steps[-1]  # stopped early, step saved


@pytest.mark.slow
def test_sigkill_and_resume_gives_the_same_metrics(tmp_path):
  full, killed = tmp_path / "full", tmp_path / "killed"
  assert _train_subprocess(full, 4, 2).wait(timeout=600) == 0
  proc = _train_subprocess(killed, 4, 2)
  deadline = time.time() + 600
  # Kill as soon as the step-2 checkpoint is complete (orbax renames its tmp dir when done).
  while not (killed / "checkpoints" / "2").is_dir() and time.time() < deadline:
    assert proc.poll() is None, "the run ended before it could be killed"
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert _train_subprocess(killed, 4, 2).wait(timeout=600) == 0
  read = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
  full_rows, resumed_rows = read(full), read(killed)
  assert [r["step"] for r in resumed_rows] == [0, 1, 2, 3]
  assert _stable(resumed_rows) == _stable(full_rows)


def test_required_checkpoint_missing_is_a_clear_error(tmp_path):
  trainer = loop.Trainer(tiny_config(), tmp_path)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    trainer.run(resume="required")


@pytest.mark.slow
def test_selector_decisions_are_logged_and_respect_the_memory_budget(tmp_path):
  c = tiny_config()
  # A simulated per-device limit below the default update plan's peak (about 10 MB predicted) and
  # above the micro-batched plans' (about 2.6 MB compiled).
  budget_gib = 0.003
  cfg = dataclasses.replace(
    c,
    parallel=dataclasses.replace(c.parallel, selector=True, memory_budget_gib=budget_gib),
    train=dataclasses.replace(c.train, eval_every=0),
  )
  rows = loop.Trainer(cfg, tmp_path).run()
  assert [r["step"] for r in rows] == [0, 1]
  events = metrics_lib.read_events(tmp_path, kind="selector_decision")
  assert sorted({(e["step"], e["stage"]) for e in events}) == [
    (s, stage) for s in (0, 1) for stage in ("reference", "rollout", "update")
  ]
  for e in events:
    assert e["compiled_bytes"] is None or e["compiled_bytes"] <= budget_gib * 2**30, e
  update = [e for e in events if e["stage"] == "update"]
  # The budget constrained the choice: some plan was rejected for memory, a fitting one ran.
  assert any("B > budget" in why for e in update for _, why in e["rejected"]), update[0]
  assert all(r["dispatch/bytes_through_host"] == 0 for r in rows)


@pytest.mark.slow
def test_ppo_epochs_and_mini_batches_in_the_loop(tmp_path):
  """2 epochs x 2 mini-batches (micro_batch_size 0 = the whole mini-batch): pi_old is scored by
  the reference stage and the train state takes 4 optimiser steps per rollout batch."""
  c = dataclasses.replace(tiny_config(num_steps=1, eval_every=0).rl, ppo_epochs=2, mini_batches=2)
  cfg = dataclasses.replace(tiny_config(num_steps=1, eval_every=0), rl=c)
  assert cfg.rl.needs_old_logps and cfg.parallel.update_layout.micro_batch_size == 0
  trainer = loop.Trainer(cfg, tmp_path)
  (row,) = trainer.run()
  assert int(trainer.state.step) == 4 and row["update/skipped_updates"] == 0
  assert row["update/ratio_max"] > 0 and row["update/loss"] == row["update/loss"]  # not NaN


@pytest.mark.slow
def test_restricted_answers_sample_and_score_only_the_moves(tmp_path, monkeypatch):
  """sampler.restrict_answers without legal_answers: every answer token is a move token, and the
  reference (the policy itself at step 0) scores each answer exactly as the sampler did, so the
  PPO ratio and the KL compare the same restricted distribution."""
  import numpy as np

  c = tiny_config(num_steps=1, eval_every=1)
  cfg = dataclasses.replace(
    c,
    sampler=dataclasses.replace(c.sampler, restrict_answers=True, legal_answers=False),
    rollout=dataclasses.replace(c.rollout, max_new_tokens=1),
    rl=dataclasses.replace(c.rl, loss=dataclasses.replace(c.rl.loss, kl_beta=0.01)),
  )
  seen, real = [], stages.StageResources.score
  monkeypatch.setattr(
    stages.StageResources, "score", lambda s, b: seen.append((b, real(s, b))) or seen[-1][1]
  )
  trainer = loop.Trainer(cfg, tmp_path)
  (row,) = trainer.run()
  tok = trainer.setup.tokenizer
  assert [tok.decode([i]) for i in trainer.stages.answer_ids] == list("0123456")
  ((batch, scored),) = seen
  answers = np.asarray(batch.loss_mask_BxT)
  tokens = np.asarray(batch.tokens_BxT)[answers]
  assert answers.sum() > 0 and set(tokens.tolist()) <= set(trainer.stages.answer_ids)
  np.testing.assert_allclose(
    np.asarray(scored.ref_logps_BxT)[answers], np.asarray(batch.sampler_logps_BxT)[answers],
    atol=2e-5,
  )  # fmt: skip
  assert row["update/loss"] == row["update/loss"] and row["eval/random/win_rate"] >= 0


@pytest.mark.slow
def test_legal_answers_play_only_legal_moves_and_score_them_as_sampled(tmp_path, monkeypatch):
  """sampler.legal_answers: every answer is one of the moves legal on its turn (no invalid move
  in training or evaluation, an untrained policy included), the batch carries each turn's mask,
  and the reference scores every answer under that mask exactly as the sampler drew it. With
  the imitation term on, the batch also carries the env's expert labels of each turn, and the
  update counts them."""
  import numpy as np

  c = tiny_config(num_steps=1, eval_every=1)
  loss = dataclasses.replace(c.rl.loss, kl_beta=0.01, imitation_coef=0.5)
  cfg = dataclasses.replace(
    c,
    sampler=dataclasses.replace(c.sampler, restrict_answers=True, legal_answers=True),
    rollout=dataclasses.replace(c.rollout, max_new_tokens=1),
    rl=dataclasses.replace(c.rl, loss=loss, imitation_steps=1),
  )
  seen, real = [], stages.StageResources.score
  monkeypatch.setattr(
    stages.StageResources, "score", lambda s, b: seen.append((b, real(s, b))) or seen[-1][1]
  )
  # 4 turns fill no column: narrow each mask to fewer legal moves, a different set every turn.
  legal_bits = games.GameEnv.legal_answer_bits
  monkeypatch.setattr(
    games.GameEnv,
    "legal_answer_bits",
    lambda env: legal_bits(env) & ~(0b11 << len(env.state.history()) % 6),
  )
  # An expert with an opinion on every other turn (4 turns rarely hold a real threat).
  monkeypatch.setattr(
    games.GameEnv,
    "expert_answer_bits",
    lambda env: 0b101 << len(env.state.history()) % 4 if len(env.state.history()) % 4 else 0,
  )
  trainer = loop.Trainer(cfg, tmp_path)
  (row,) = trainer.run()
  ((batch, scored),) = seen
  answers = np.asarray(batch.loss_mask_BxT)
  bits = np.asarray(batch.answer_bits_BxT)
  assert (bits[~answers] == -1).all() and (bits[answers] > 0).all()
  assert len(set(bits[answers].tolist())) > 1 and (bits[answers] < 2**7 - 1).all()
  column = {t: j for j, t in enumerate(trainer.stages.answer_ids)}
  moves = np.asarray([column[int(t)] for t in np.asarray(batch.tokens_BxT)[answers]])
  assert ((bits[answers] >> moves) & 1 == 1).all()  # each answer legal under its own mask
  expert = np.asarray(batch.expert_bits_BxT)
  assert (expert[~answers] == 0).all() and (expert[answers] > 0).sum() > 0
  assert (expert[answers] == 0).sum() > 0  # turns without an opinion stay unlabelled
  assert row["update/imitation_tokens"] == (expert[answers] > 0).sum()
  assert row["update/imitation_loss"] > 0
  np.testing.assert_allclose(
    np.asarray(scored.ref_logps_BxT)[answers], np.asarray(batch.sampler_logps_BxT)[answers],
    atol=2e-5,
  )  # fmt: skip
  invalid = [k for k in row if k.endswith(("invalid_rate", "invalid_answer_rate"))]
  assert {"train/invalid_answer_rate", "eval/random/invalid_answer_rate"} <= set(invalid), row
  assert all(row[k] == 0 for k in invalid), {k: row[k] for k in invalid}
  assert row["update/loss"] == row["update/loss"]
  # A watched game (Trainer.play) decodes under the same masks: legal moves only.
  turns = trainer.play("heuristic")
  assert len(turns) > 1 and all(t["reply"] in "0123456" for t in turns[1:]), turns
  assert all(t["observation"] != "invalid" and t["outcome"] != "invalid" for t in turns[1:])


@pytest.mark.slow
def test_out_of_memory_in_a_stage_replans_and_the_step_is_not_lost(tmp_path, monkeypatch):
  """An injected RESOURCE_EXHAUSTED in the reference and the update stage at step 0: each plan
  is marked infeasible, the selector picks another, the step runs again and the run ends with
  every optimiser step taken."""
  import jax

  c = tiny_config(num_steps=2, eval_every=0)
  parallel = dataclasses.replace(c.parallel, selector=True, memory_budget_gib=1.0)
  cfg = dataclasses.replace(c, parallel=parallel)
  failed, stage_of = {}, {"score": stages.Stage.REFERENCE, "update": stages.Stage.UPDATE}

  def fail_once(name, real):
    def run(self, batch):
      if name not in failed:
        failed[name] = self.plans[stage_of[name]]
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (injected)")
      return real(self, batch)

    return run

  for name in ("score", "update"):
    monkeypatch.setattr(
      stages.StageResources, name, fail_once(name, getattr(stages.StageResources, name))
    )
  trainer = loop.Trainer(cfg, tmp_path)
  rows = trainer.run()
  assert [r["step"] for r in rows] == [0, 1]
  assert int(trainer.state.step) == 2 * cfg.rl.optimizer_steps
  ooms = metrics_lib.read_events(tmp_path, kind="out_of_memory")
  assert sorted(e["stage"] for e in ooms) == ["reference", "update"]
  assert all(e["step"] == 0 and "injected" in e["error"] for e in ooms)
  # The plan that failed is never chosen again for that stage.
  for name, plan in failed.items():
    stage = stage_of[name].value
    later = [
      e for e in metrics_lib.read_events(tmp_path, kind="selector_decision") if e["stage"] == stage
    ]
    assert later[-1]["plan"] != plan.describe()
    assert trainer.plans[stage_of[name]] != plan


@pytest.mark.slow
def test_a_rollout_plan_with_waves_decodes_fewer_slots_and_plays_every_episode(
  tmp_path, monkeypatch
):
  c = tiny_config(num_steps=1, eval_every=0)
  layout = dataclasses.replace(c.parallel.rollout_layout, data=4, tensor=2, micro_batch_size=4)
  cfg = dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, rollout_layout=layout))
  played, real = [], stages.StageResources.rollout
  monkeypatch.setattr(
    stages.StageResources,
    "rollout",
    lambda s, *a, **k: played.append(real(s, *a, **k)) or played[-1],
  )
  trainer = loop.Trainer(cfg, tmp_path)
  (row,) = trainer.run()
  assert cfg.rollout.num_slots == 8 and trainer.stages.kv_cache.k.shape[1] == 4
  (result,) = played
  assert len(result.episodes) == result.batch.tokens_BxT.shape[0] == cfg.rl.batch_size
  assert sorted(e.seed for e in result.episodes) == sorted(e.seed for e in trainer.episodes(0))
  assert row["update/loss"] == row["update/loss"]


@pytest.mark.slow
def test_continuous_batching_trains_on_a_sharded_rollout_plan_and_is_reproducible(tmp_path):
  """rollout.batching=continuous through the trainer on a (data 4, tensor 2) rollout plan with
  waves of 4 slots: every episode is played, and a second run gives the same metrics (the
  schedule depends on what was decoded, never on timing)."""
  c = tiny_config(num_steps=2, eval_every=0)
  layout = dataclasses.replace(c.parallel.rollout_layout, data=4, tensor=2, micro_batch_size=4)
  # Free-text answers of up to 2 tokens (continuous batching has no per-turn answer masks, and
  # turns of one token would never leave the batch early).
  cfg = dataclasses.replace(
    c,
    parallel=dataclasses.replace(c.parallel, rollout_layout=layout),
    sampler=dataclasses.replace(c.sampler, restrict_answers=False, legal_answers=False),
    rollout=dataclasses.replace(c.rollout, batching="continuous", decode_steps=1, max_new_tokens=2),
    # The imitation term labels restricted answers turn by turn (turn batching only).
    rl=dataclasses.replace(c.rl, loss=dataclasses.replace(c.rl.loss, imitation_coef=0.0)),
  )
  rows = [loop.Trainer(cfg, tmp_path / f"run{i}").run() for i in range(2)]
  assert len(rows[0]) == 2 and rows[0][-1]["rollout/generated_tokens"] > 0
  assert _stable(rows[0]) == _stable(rows[1])
