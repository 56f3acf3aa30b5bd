"""Rollout and serving throughput: continuous batching vs turn-synchronous, side by side.

  PYTHONPATH=. python benchmarks/rollout.py                      # all three parts
  PYTHONPATH=. python benchmarks/rollout.py --parts longtail --slots 16 --episodes 128

(longtail) The long-tailed workload of ``benchmarks/longtail.py`` (replies of a few to hundreds of
  tokens, episodes of 1 to 12 turns) played by the same random-weight model with the same slot
  count through the turn-synchronous rollout (every row decodes until the slowest stops, then the
  envs step one after another) and the continuous one (``rollout.batching=continuous``): generated
  tokens/s, episodes/s and makespan, medians of interleaved repetitions, each run once untimed
  beforehand with the same key, so no timed run compiles (the count is printed); with and
  without a simulated tool latency per env step.
(serving) The same model behind JetStream: concurrent gRPC ``Decode`` requests through
  ``launch/serve.py``'s server on localhost vs the same requests through the Engine API called
  directly (prefill / insert / generate in one loop, no threads, no gRPC): tokens/s.
(config) A config's own rollout (default: the tiny default run; the policy is untrained, and
  --set KEY=VALUE overrides a key) with ``rollout.batching`` turn and continuous: seconds per
  rollout of the training batch.

Runs on one CPU device unless XLA_FLAGS says otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from flax import nnx

from benchmarks import longtail
from earl_jax import config_lib, hostmem
from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.rl import rollout, turn_format
from earl_jax.sampler import engine, slots

TOK = model_lib.CharTokenizer()


def _model(width: int, layers: int) -> tuple[nnx.GraphDef, nnx.State, ModelConfig]:
  cfg = ModelConfig(
    vocab_size=TOK.vocab_size, embed_dim=width, mlp_dim=3 * width, num_layers=layers,
    num_heads=max(1, width // 64), num_kv_heads=max(1, width // 128), head_dim=64,
    max_seq_len=4096,
  )  # fmt: skip
  graphdef, params = nnx.split(model_lib.Decoder(cfg, rngs=nnx.Rngs(0)))
  return graphdef, params, cfg


_COMPILES = [0]  # XLA compilations so far in this process (JAX's backend-compile events)


def _count_compiles(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def _median_row(runs: list[rollout.RolloutResult]) -> dict[str, float]:
  s = statistics.median(r.seconds for r in runs)
  tok = statistics.median(r.generated_tokens / r.seconds for r in runs)
  eps = statistics.median(len(r.episodes) / r.seconds for r in runs)
  return {"seconds": s, "tok/s": tok, "episodes/s": eps, "calls": runs[0].turns}


def longtail_part(args) -> None:
  graphdef, params, mcfg = _model(args.width, args.layers)
  spec = engine.GenerationSpec.with_stop_ids(
    TOK.stop_ids,
    strategy=longtail.StopWithProbability(TOK.end_id, args.stop_p),
    max_new_tokens=args.max_new,
    pad_id=TOK.pad_id,
  )
  rc = rollout.RolloutConfig(
    num_slots=args.slots, max_turns=12, max_new_tokens=args.max_new, max_context=4096,
    chunk_multiple=16, decode_steps=args.decode_steps,
  )  # fmt: skip
  fmt = turn_format.PlainFormat(TOK)
  episodes = [rollout.EpisodeSpec(seed=1000 + i, group_id=i) for i in range(args.episodes)]
  turn_fn = engine.make_generate_fn(graphdef, spec)
  progs = slots.SlotPrograms(graphdef, spec, steps=min(args.decode_steps, args.max_new))
  cache_len = 2048

  def turn(envs, key):
    gen = lambda cache, *a: turn_fn(params, cache, *a)  # noqa: E731
    cache = model_lib.init_cache(mcfg, args.slots, cache_len)
    return rollout.run_rollout(gen, cache, envs, fmt, episodes, rc, key, pad_id=TOK.pad_id)[0]

  def continuous(envs, key):
    cache = model_lib.init_cache(mcfg, args.slots, cache_len)
    state = progs.new_state(cache, mcfg.padded_vocab_size, key)
    return rollout.run_rollout_continuous(
      progs.bind(params), state, envs, fmt, episodes, rc, key, pad_id=TOK.pad_id
    )[0]

  print(f"\n(longtail) {mcfg.num_params / 1e6:.1f}M-parameter model, {args.slots} slots, "
        f"{args.episodes} episodes, replies ~ geometric(mean {1 / args.stop_p:.0f}, cut at "
        f"{args.max_new}) tokens, 1-12 turns (mean 3); continuous decodes {progs.steps} tokens "
        f"a call; medians of {args.repeats} interleaved runs")  # fmt: skip
  print("| env latency | mode | makespan s | generated tok/s | episodes/s | device calls |")
  print("|---|---|---|---|---|---|")
  modes = (("turn", turn), ("continuous", continuous))
  # Warm-up: every timed run (same key, same episodes, so the same shapes) once beforehand, so
  # that no timed run compiles a program; the latency does not change the shapes.
  warm_envs = [longtail.LongTailEnv(latency_ms=0.0) for _ in range(args.slots)]
  for r in range(args.repeats):
    for _, fn in modes:
      fn(warm_envs, jax.random.key(r))
  compiles = _COMPILES[0]
  for latency in args.latencies:
    envs = [longtail.LongTailEnv(latency_ms=latency) for _ in range(args.slots)]
    runs = {"turn": [], "continuous": []}
    for r in range(args.repeats):
      for name, fn in modes:
        runs[name].append(fn(envs, jax.random.key(r)))
    rows = {k: _median_row(v) for k, v in runs.items()}
    for name, row in rows.items():
      print(f"| {latency:g} ms | {name} | {row['seconds']:.2f} | {row['tok/s']:.0f} | "
            f"{row['episodes/s']:.2f} | {row['calls']} |")  # fmt: skip
    ratio = rows["continuous"]["tok/s"] / rows["turn"]["tok/s"]
    print(f"| {latency:g} ms | continuous / turn (tokens/s) | {ratio:.2f}x | | | |")
  print(f"compilations during the timed runs: {_COMPILES[0] - compiles}")


def _requests(n: int, rng: np.random.Generator) -> list[str]:
  out = []
  for _ in range(n):
    text = "".join(chr(c) for c in rng.integers(ord("a"), ord("z") + 1, int(rng.integers(5, 60))))
    out.append(f"<bos><usr>{text}<end><asst>")
  return out


def serving_part(args) -> None:
  from earl_jax.serve import engine as serve_engine
  from earl_jax.serve import server as serve_server

  graphdef, params, mcfg = _model(args.width, args.layers)
  config = serve_engine.EngineConfig(
    num_slots=args.slots, max_prefill_length=128, max_decode_length=args.serve_tokens
  )
  eng = serve_engine.Engine(graphdef, params, mcfg, TOK, config)
  prompts = _requests(args.requests, np.random.default_rng(0))

  def direct() -> int:
    return sum(len(r) for r in eng.decode_all(prompts, args.serve_tokens))

  def grpc_run(address: str) -> int:
    with concurrent.futures.ThreadPoolExecutor(args.slots) as pool:
      calls = [pool.submit(serve_server.decode, address, text=p, max_tokens=args.serve_tokens)
               for p in prompts]  # fmt: skip
      return sum(len(c.result()[1]) for c in calls)

  times = {"engine API, direct": [], "gRPC server": []}
  with serve_server.Server(eng, port=0) as server:
    for r in range(args.repeats + 1):
      for name, fn in (
        ("engine API, direct", direct),
        ("gRPC server", lambda: grpc_run(server.address)),
      ):
        t = time.perf_counter()
        produced = fn()
        if r:
          times[name].append(produced / (time.perf_counter() - t))
  print(f"\n(serving) {mcfg.num_params / 1e6:.1f}M-parameter model, {args.slots} slots, "
        f"{args.requests} requests of up to {args.serve_tokens} tokens (random weights: most run "
        f"to the limit), greedy; medians of {args.repeats}")  # fmt: skip
  print("| path | generated tok/s |")
  print("|---|---|")
  for name, rates in times.items():
    print(f"| {name} | {statistics.median(rates):.0f} |")
  ratio = statistics.median(times["gRPC server"]) / statistics.median(times["engine API, direct"])
  print(f"| gRPC / direct | {ratio:.2f}x |")


def config_part(args) -> None:
  from earl_jax.rl import loop

  trainers: dict[str, loop.Trainer] = {}
  for mode in ("turn", "continuous"):
    # Both modes without per-turn answer masks: continuous batching has none (nor the imitation
    # term's labels, which the rollouts timed here do not record anyway).
    overrides = [
      *args.set,
      f"rollout.batching={mode}",
      "sampler.legal_answers=False",
      "rl.loss.imitation_coef=0.0",
    ]
    cfg = config_lib.load_config_file(args.config, overrides)
    trainers[mode] = loop.Trainer(cfg, tempfile.mkdtemp(prefix=f"earl_rollout_{mode}_"))
  episodes = trainers["turn"].episodes(0)

  def run(t: loop.Trainer, r: int) -> rollout.RolloutResult:
    params, _ = t.stages.rollout_weights()
    return t.stages.rollout(params, episodes, t.envs, t.fmt, jax.random.key(r))

  # Warm-up, untimed: a stage keeps the KV cache its first rollout grew, so the second rollout
  # (a long cache, short prompts) still compiles; run until a rollout compiles nothing.
  for t in trainers.values():
    for _ in range(4):
      before = _COMPILES[0]
      run(t, 0)
      if _COMPILES[0] == before:
        break
  seconds = {m: [] for m in trainers}
  compiles = 0
  for r in range(args.repeats):
    for mode, t in trainers.items():
      run(t, r)  # untimed: compiles what this key's lengths need (the same in the timed run)
      before = _COMPILES[0]
      seconds[mode].append(run(t, r).seconds)
      compiles += _COMPILES[0] - before
  extra = "".join(f", {o}" for o in args.set)
  print(f"\n(config) {args.config}{extra}, sampler.legal_answers=False: one training rollout "
        f"({len(episodes)} episodes), untrained policy, {jax.device_count()} device(s); "
        f"medians of {args.repeats}")  # fmt: skip
  print("| rollout.batching | seconds |")
  print("|---|---|")
  for mode, s in seconds.items():
    print(f"| {mode} | {statistics.median(s):.3f} |")
  print(f"compilations during the timed runs: {compiles}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--parts", default="longtail,serving,config")
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--episodes", type=int, default=128)
  p.add_argument("--max-new", type=int, default=256)
  p.add_argument("--stop-p", type=float, default=1 / 40)
  p.add_argument("--decode-steps", type=int, default=4)
  p.add_argument("--latencies", type=float, nargs="+", default=[0.0, 20.0])
  p.add_argument("--requests", type=int, default=48)
  p.add_argument("--serve-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--config", default="configs/connect_four_tiny.py")
  p.add_argument(
    "--set", action="append", default=[], metavar="KEY=VALUE",
    help="(config) override a key of --config, e.g. --set rl.num_groups=2 (repeatable)",
  )  # fmt: skip
  args = p.parse_args()
  print(hostmem.host_line())
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} device(s)")
  parts = {"longtail": longtail_part, "serving": serving_part, "config": config_part}
  for name in args.parts.split(","):
    parts[name](args)


if __name__ == "__main__":
  main()
