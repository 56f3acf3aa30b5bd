r"""A training run's policy as a Hugging Face checkpoint that transformers loads.

  python launch/export.py --workdir W --out DIR [--step N] [--dtype bfloat16] [--max-shard-gib 2]

Writes DIR/config.json, model.safetensors (or numbered shards + model.safetensors.index.json) and
the run's tokenizer files (when it used a Hugging Face tokenizer). Reads the newest checkpoint
step of W unless --step is given; only the policy's parameters are read, one at a time.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--workdir", required=True, help="the training run's workdir")
  p.add_argument("--out", required=True, help="output directory (created)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 on disk")
  p.add_argument("--max-shard-gib", type=float, default=2.0, help="largest safetensors file")
  args = p.parse_args(argv)

  from earl_jax import cli, export

  try:
    out = export.export_workdir(
      args.workdir,
      args.out,
      step=args.step,
      dtype=args.dtype,
      max_shard_bytes=int(args.max_shard_gib * 2**30),
    )
  except cli.USER_ERRORS as e:
    return cli.fail(e)
  print(f"exported step {out.step} ({out.num_params:,} parameters, {args.dtype}) to {out.out_dir}")
  print(f"files: {', '.join(out.files)}")
  print(f"tokenizer: {out.tokenizer}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
