r"""Serve a trained policy (or a Hugging Face checkpoint) through JetStream on localhost.

  python launch/serve.py --workdir runs/connect_four_tiny [--port 9000] [--step N]
  python launch/serve.py --pretrained DIR [--port 9000]

Starts JetStream's orchestrator (continuous batching over --slots decode slots) and its gRPC
``Orchestrator`` service (``Decode`` with text or token content, ``HealthCheck``). A workdir's
policy decodes with the run's evaluation sampler (greedy by default), prompts up to the run's
rollout.max_context and replies up to rollout.max_new_tokens; --max-prefill / --max-decode change
that; --data/--fsdp/--tensor lay the policy and the slots out on that many devices. Play
against it with ``python launch/play.py --server localhost:9000 --workdir W``.
Ctrl-C stops the server. Needs the serve extra: pip install -e ".[serve]".
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import signal
import sys
import threading

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def _engine_config(args, run_cfg):
  from earl_jax.serve import engine

  if run_cfg is not None:
    fits = [n for n in engine.PREFILL_LENGTHS if n >= run_cfg.rollout.max_context]
    prefill = args.max_prefill or (fits[0] if fits else engine.PREFILL_LENGTHS[-1])
    decode = args.max_decode or run_cfg.rollout.max_new_tokens
    answer_ids = ()
    if run_cfg.sampler.restrict_answers:  # serve the policy as trained: answers restricted too
      from earl_jax import model as model_lib
      from earl_jax.rl import preflight

      tokenizer = model_lib.make_tokenizer(run_cfg.tokenizer)
      answer_ids = preflight.answer_token_ids(run_cfg, tokenizer)
    # A server sees text, not a game state: it cannot mask illegal moves (legal_answers).
    sampler = dataclasses.replace(run_cfg.sampler, legal_answers=False)
    strategy = sampler.make(evaluation=True, answer_ids=answer_ids)
  else:
    prefill, decode, strategy = args.max_prefill or 1024, args.max_decode or 256, None
  kwargs = {"strategy": strategy} if strategy is not None else {}
  return engine.EngineConfig(
    num_slots=args.slots, max_prefill_length=prefill, max_decode_length=decode, **kwargs
  )


def _plan(args):
  """The serving layout over the first data x fsdp x tensor devices (None: one device)."""
  import jax

  from earl_jax.parallel.plan import make_stage_plan
  from earl_jax.types import Stage

  n = args.data * args.fsdp * args.tensor
  if n == 1:
    return None
  if n > jax.device_count():
    raise ValueError(
      f"--data {args.data} x --fsdp {args.fsdp} x --tensor {args.tensor} = {n} devices; "
      f"this machine has {jax.device_count()}"
    )
  return make_stage_plan(Stage.ROLLOUT, range(n), args.data, args.fsdp, args.tensor)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir", help="a training run's workdir (its newest checkpoint)")
  source.add_argument("--pretrained", help="a Hugging Face checkpoint directory")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  p.add_argument("--port", type=int, default=9000, help="gRPC port on localhost (0: any free)")
  p.add_argument("--slots", type=int, default=8, help="concurrent decodes")
  p.add_argument("--max-prefill", type=int, default=0, help="longest prompt (a power of 2, >=16)")
  p.add_argument("--max-decode", type=int, default=0, help="longest reply in tokens")
  for axis in ("data", "fsdp", "tensor"):
    p.add_argument(f"--{axis}", type=int, default=1, help=f"layout: {axis} parallel size")
  args = p.parse_args(argv)

  try:
    from earl_jax import cli, export
    from earl_jax.serve import engine, server
  except ImportError as e:
    print(
      f"earl_jax: serving needs the serve extra ({e}): pip install -e '.[serve]'", file=sys.stderr
    )
    return 1
  try:
    plan = _plan(args)
    if args.workdir:
      run_cfg = export.run_config(args.workdir, step=args.step)
      config = _engine_config(args, run_cfg)
      eng = engine.Engine.from_workdir(args.workdir, config, step=args.step, plan=plan)
    else:
      eng = engine.Engine.from_pretrained(args.pretrained, _engine_config(args, None), plan=plan)
    srv = server.Server(eng, port=args.port)
  except cli.USER_ERRORS as e:
    return cli.fail(e)
  c = eng.config
  print(f"serving {eng.description} ({eng.model_cfg.num_params:,} parameters) on {srv.address}")
  print(
    f"JetStream Orchestrator service (Decode, HealthCheck); {c.num_slots} slots, prompts up to "
    f"{c.max_prefill_length} tokens, replies up to {c.max_decode_length}; Ctrl-C stops",
    flush=True,
  )
  stop = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.set())
  while not stop.wait(0.5):
    pass
  srv.stop()
  print("server stopped")
  return 0


if __name__ == "__main__":
  sys.exit(main())
