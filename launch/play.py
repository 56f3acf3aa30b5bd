r"""Play a game in the terminal against a policy served by launch/serve.py.

  python launch/play.py --server localhost:9000 --workdir runs/connect_four_tiny [--side second]
  python launch/play.py --server localhost:9000 --config configs/connect_four_qwen2_5_0_5b.py

The policy sees exactly what it saw in training: the run's environment options (observation,
answer format) and turn format, built here from --workdir's saved config (or --config) and sent to
the server as token ids; the server returns the reply's ids (token in, token out). The board is
drawn before each of your moves and at the end; an illegal or unreadable move is asked again.
--side first|second|any picks who opens (any: by --seed). Ctrl-D or 'q' quits.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


class Human:
  """An opponent that asks the person at the terminal (an OpenSpiel state -> action)."""

  def __init__(self, spec, read=input, write=print):
    self.spec, self.read, self.write = spec, read, write

  def __call__(self, state) -> int:
    legal = state.legal_actions()
    self.write(f"\n{self.spec.render(state)}")
    while True:
      try:
        text = self.read(f"your move ({' '.join(map(str, legal))}; q quits): ").strip()
      except EOFError:
        raise KeyboardInterrupt from None
      if text.lower() in ("q", "quit", "exit"):
        raise KeyboardInterrupt
      if text.lstrip("-").isdigit() and int(text) in legal:
        return int(text)
      self.write(f"{text!r} is not a legal move here")


def play(address: str, cfg, game: str, side: str, seed: int, read=input, write=print) -> str:
  """One game; returns the outcome from the policy's side (win, loss, draw, invalid)."""
  from earl_jax import model as model_lib
  from earl_jax.env import games
  from earl_jax.rl import turn_format
  from earl_jax.serve import server

  spec = games.GAMES[game]
  sides = {"first": games.Side.SECOND, "second": games.Side.FIRST, "any": games.Side.ALTERNATE}
  config = dataclasses.replace(cfg.env.game, model_side=sides[side])
  env = games.GameEnv(spec, config, opponent=Human(spec, read, write))
  fmt = turn_format.for_tokenizer(model_lib.make_tokenizer(cfg.tokenizer))
  me = {"first": 1, "second": 0}.get(side, seed % 2)  # the policy's player (alternate: by seed)
  write(f"you play {spec.symbols[1 - me]}; the policy plays {spec.symbols[me]}")
  observation = env.reset(seed)
  tokens = fmt.first(env.instructions, observation)
  while True:
    _, ids = server.decode(address, token_ids=tokens, max_tokens=cfg.rollout.max_new_tokens)
    reply = fmt.action_text(ids)
    write(f"policy: {reply!r}")
    result = env.step(reply)
    if result.done:
      outcome = result.info["outcome"]
      write(f"\n{spec.render(env.state)}\npolicy's result: {outcome}")
      return outcome
    if result.info.get("legal") is False:
      write("(the policy's answer was not a legal move; it is asked again)")
    # The reply's stop token is not returned by the server: close the turn as the format does.
    tokens = tokens + list(ids) + fmt.next(result.observation, stopped=False)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--server", required=True, help="host:port of launch/serve.py")
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir", help="the served run's workdir (its saved config)")
  source.add_argument("--config", help="a config file (e.g. for a --pretrained server)")
  p.add_argument("--game", default="", help="connect_four | tic_tac_toe (default: the run's)")
  p.add_argument("--side", default="first", choices=("first", "second", "any"))
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  try:
    import grpc

    from earl_jax import cli, config_lib, export
    from earl_jax.env import games
  except ImportError as e:
    print(
      f"earl_jax: playing needs the serve extra ({e}): pip install -e '.[serve]'", file=sys.stderr
    )
    return 1
  try:
    if args.workdir:
      cfg = export.run_config(args.workdir)
    else:
      cfg = config_lib.load_config_file(args.config)
    game = args.game or cfg.env.name
    if game not in games.GAMES:
      raise ValueError(f"--game={game!r}; a board game: one of {sorted(games.GAMES)}")
    play(args.server, cfg, game, args.side, args.seed)
  except KeyboardInterrupt:
    print("\nbye")
    return 0
  except grpc.RpcError as e:
    return cli.fail(f"the server at {args.server} answered {e.code().name}: {e.details()}")
  except cli.USER_ERRORS as e:
    return cli.fail(e)
  return 0


if __name__ == "__main__":
  sys.exit(main())
