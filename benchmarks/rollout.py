"""Multi-turn rollout throughput and context growth of a config, on the simulated CPU devices.

  PYTHONPATH=. python benchmarks/rollout.py --config=configs/connect_four_tiny.py \
      [--workdir=runs/connect_four_tiny]   # a trained policy from that workdir's checkpoint

Prints episodes/s, generated tokens/s and the context-length distribution of the episodes by the
number of model turns they lasted (a trained policy plays longer, legal games). Timing is the
best of --repeats rollouts of the same episodes after a warm-up (compilation) rollout.
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np

from earl_jax import checkpoint as checkpoint_lib
from earl_jax import config_lib
from earl_jax.rl import loop, rollout
from earl_jax.types import Stage


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/connect_four_tiny.py")
  parser.add_argument("--workdir", default="", help="restore the policy from this run")
  parser.add_argument("--episodes", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  cfg = config_lib.load_config_file(args.config)
  trainer = loop.Trainer(cfg, args.workdir or "/tmp/earl_rollout_bench")
  if args.workdir:
    ckpt = checkpoint_lib.Checkpointer(
      os.path.join(args.workdir, "checkpoints"), save_every=1, keep=1
    )
    trainer.restore(ckpt, resume="required")
  params, _ = trainer.stages.rollout_weights()
  episodes = [rollout.EpisodeSpec(seed=10**8 + i, group_id=0) for i in range(args.episodes)]
  results = []
  for r in range(args.repeats + 1):  # the first one compiles
    rng = jax.random.key(r)
    results.append(trainer.stages.rollout(params, episodes, trainer.envs, trainer.fmt, rng))
  timed = results[1:]
  best = min(timed, key=lambda x: x.seconds)
  print(
    f"config {args.config}; policy: {args.workdir or 'untrained'}; {jax.device_count()} devices"
  )
  print(f"plan: {trainer.plans[Stage.ROLLOUT].describe()}")
  n = len(timed)
  print(f"| episodes | seconds (best of {n}) | episodes/s | generated tokens/s | generate calls |")
  print("|---|---|---|---|---|")
  print(
    f"| {len(episodes)} | {best.seconds:.2f} | {len(episodes) / best.seconds:.1f} | "
    f"{best.generated_tokens / best.seconds:.0f} | {best.turns} |"
  )
  by_turns = collections.defaultdict(list)
  for e in best.episodes:
    by_turns[e.turns].append(e.context_len)
  print("\n| model turns | episodes | context mean | p50 | p90 | max |")
  print("|---|---|---|---|---|---|")
  for turns in sorted(by_turns):
    c = np.asarray(by_turns[turns])
    print(
      f"| {turns} | {len(c)} | {c.mean():.0f} | {np.percentile(c, 50):.0f} | "
      f"{np.percentile(c, 90):.0f} | {c.max()} |"
    )
  outcomes = collections.Counter(e.outcome for e in best.episodes)
  print("\noutcomes:", dict(outcomes))


if __name__ == "__main__":
  main()
