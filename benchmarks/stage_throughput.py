"""Tokens per second of each RL stage of a config, on this machine's devices, as the trainer runs
them (its plans, programs and weights).

  PYTHONPATH=. python benchmarks/stage_throughput.py --config=configs/connect_four_qwen2_5_0_5b.py \
      --random_weights --context 2048 [--repeats 3] [--config.<key>=<value> ...]

rollout    multi-turn episodes of the config's env (a training rollout: sampling, env steps on
           the host, the KV cache across turns); generated tokens / s.
reference  the reference stage on a batch of rl.batch_size rows x --context tokens (every token
           real); scored tokens / s. Both pi_ref and pi_old when the config scores both.
update     the update stage (every optimiser step of one batch) on that batch; tokens / s.

Each stage runs once to compile, then --repeats times; the table gives the median and the range,
each call timed until its outputs are ready. ``--random_weights`` builds the checkpoint's
architecture (its preset, from ``pretrained_path``) with random weights and the character
tokenizer: no download, and the decode still runs max_new_tokens per turn (random text stops
nothing), so rollout episodes end early on invalid moves; their mean context is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from earl_jax import config_lib, fit, hostmem
from earl_jax.model.config import TokenizerConfig, TokenizerKind
from earl_jax.rl import batches, loop


def _config(args, overrides) -> config_lib.ExperimentConfig:
  cfg = config_lib.load_config_file(args.config, overrides)
  rc = dataclasses.replace(cfg.rollout, max_context=min(cfg.rollout.max_context, args.context))
  if not args.random_weights:
    return dataclasses.replace(cfg, rollout=rc)
  model = dataclasses.replace(fit.model_config(cfg), max_seq_len=args.context)
  tok = TokenizerConfig(kind=TokenizerKind.CHAR)
  return dataclasses.replace(cfg, pretrained_path="", model=model, tokenizer=tok, rollout=rc)


def _batch(cfg: config_lib.ExperimentConfig, t: int) -> batches.RolloutBatch:
  b, rng = cfg.rl.batch_size, np.random.default_rng(0)
  tokens = rng.integers(1, 100, size=(b, t)).astype(np.int32)
  ones = np.ones((b, t), bool)
  return batches.RolloutBatch.create(
    tokens_BxT=tokens,
    positions_BxT=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
    valid_BxT=ones,
    loss_mask_BxT=ones,
    sampler_logps_BxT=np.full((b, t), -1.0, np.float32),
    rewards_B=rng.normal(size=b).astype(np.float32),
    group_ids_B=np.repeat(np.arange(cfg.rl.num_groups, dtype=np.int32), cfg.rl.group_size),
  )


def _timed(fn, repeats: int) -> tuple[list[float], object]:
  out = fn()  # compiles
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return times, out


def measure(cfg: config_lib.ExperimentConfig, context: int, repeats: int) -> list[tuple]:
  """(stage, tokens per call, seconds per call, note) rows."""
  with tempfile.TemporaryDirectory() as workdir:
    trainer = loop.Trainer(cfg, workdir)
    stages, rows = trainer.stages, []
    params, _ = stages.rollout_weights()
    episodes = trainer.episodes(0)

    def play():
      key = jax.random.key(0)
      return stages.rollout(params, episodes, trainer.envs, trainer.fmt, key)

    times, result = _timed(play, repeats)
    mean_ctx = float(np.mean([e.context_len for e in result.episodes]))
    rows.append(("rollout", result.generated_tokens, times, f"mean context {mean_ctx:.0f}"))
    batch = _batch(cfg, context)
    times, scored = _timed(lambda: stages.score(batch), repeats)
    rows.append(("reference", batch.tokens_BxT.size, times, f"{cfg.rl.batch_size} x {context}"))
    adv, _ = stages.to_update(trainer._advantages(scored))
    times, _ = _timed(lambda: stages.update(adv), repeats)
    steps = cfg.rl.optimizer_steps
    rows.append(("update", batch.tokens_BxT.size, times, f"{steps} optimiser step(s)"))
    print(trainer.plans.describe())
    trainer.close()
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--context", type=int, default=2048)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--random_weights", action="store_true")
  args, rest = parser.parse_known_args(argv)
  overrides = [a[len("--config.") :] for a in rest if a.startswith("--config.")]
  if len(overrides) != len(rest):
    sys.exit(f"unknown arguments {rest}: only --config.<key>=<value> overrides")
  cfg = _config(args, overrides)
  devices = jax.devices()
  print(hostmem.host_line())
  print(f"{args.config}: {len(devices)} x {devices[0].device_kind}, jax {jax.__version__}")
  print(f"{'stage':10} {'tokens/s':>12} {'range':>25} {'tokens/call':>12}  notes")
  for stage, tokens, times, note in measure(cfg, args.context, args.repeats):
    rates = sorted(tokens / t for t in times)
    print(
      f"{stage:10} {statistics.median(rates):12.1f} {f'{rates[0]:.1f}..{rates[-1]:.1f}':>25} "
      f"{tokens:12d}  {note}"
    )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
