"""Entry point: parse flags, validate the config, train.

  python launch/train.py                                   # configs/connect_four_tiny.py on CPU
  python launch/train.py --config=configs/<exp>.py --config.rl.loss.kl_beta=0.01 --workdir=/tmp/run

Kept thin on purpose: everything it calls is importable from a notebook (``earl_jax.rl.loop``).
On a CPU-only machine JAX gets one device by default: measured on 2 cores, the default run's step
took 0.44 s on 1 device and 0.56 s on 8 simulated ones (data-parallel programs on 8 devices
synchronise every decode step). ``--cpu_devices=8`` simulates 8, so the per-stage layouts are
real meshes (the tests use 8). The launcher re-executes itself once so glibc's malloc backs
large buffers with transparent huge pages (``earl_jax.hostmem``; ``--nohost_thp`` does not).
"""

from __future__ import annotations

import os
import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))  # so config files can `from configs import base`


def _cpu_devices(argv: list[str]) -> int:
  for i, arg in enumerate(argv):
    if arg.startswith("--cpu_devices="):
      return int(arg.split("=", 1)[1])
    if arg == "--cpu_devices" and i + 1 < len(argv):
      return int(argv[i + 1])
  return 1


if __name__ == "__main__":
  from earl_jax import hostmem

  if hostmem.wanted(sys.argv):  # glibc reads GLIBC_TUNABLES at start-up: re-executes if needed
    hostmem.reexec_with_thp()
  # Must be set before jax initialises its backends; only the host (CPU) platform reads it.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={_cpu_devices(sys.argv)}"
  )

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from earl_jax import config_lib  # noqa: E402


def _fail(message: str) -> None:
  """One line on stderr and exit status 2: no traceback, no flag help."""
  sys.exit(f"earl_jax: {' '.join(message.split())}")


def _load_config_file(path: str):
  """The ConfigDict of a config file, or a one-line exit naming what is wrong with the file."""
  try:
    return config_lib.read_config_file(path)
  except config_lib.ConfigFileError as e:
    _fail(f"--config: {e.problem}")


def _check_overrides(argv: list[str]) -> None:
  """Loads the config file and names an unknown ``--config.<key>`` override clearly
  (config_flags only says KeyError, and prints a traceback for a broken file)."""
  path = str(_REPO / "configs" / "connect_four_tiny.py")
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith("--config="):
      path = arg.split("=", 1)[1].split(":", 1)[0]
    elif arg == "--config" and i + 1 < len(argv):
      path = argv[i + 1].split(":", 1)[0]
  config = _load_config_file(path)
  for arg in argv[1:]:
    if not arg.startswith("--config."):
      continue
    node, walked = config, []
    for key in arg[len("--config.") :].split("=", 1)[0].split("."):
      if not hasattr(node, "keys") or key not in node:
        known = sorted(node.keys()) if hasattr(node, "keys") else []
        where = ".".join(walked) or "<root>"
        _fail(f"{arg}: unknown config key {key!r} under {where!r}; known keys: {known}")
      node, walked = node[key], [*walked, key]


if __name__ == "__main__":
  _check_overrides(sys.argv)  # before config_flags, which parses overrides at definition

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  str(_REPO / "configs" / "connect_four_tiny.py"),
  "Experiment config file (configs/*.py); override keys with --config.<key>=<value>.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "", "Checkpoints, metrics and profiles; default runs/<config file name>."
)
flags.DEFINE_integer(
  "cpu_devices", 1, "Simulated devices when JAX runs on the CPU (1 is fastest; 8 to see meshes)."
)
flags.DEFINE_bool(
  "host_thp",
  True,
  "Start with glibc's malloc on transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1; "
  "the launcher re-executes itself): far fewer page faults in XLA:CPU's large buffers.",
)
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
  "allow_config_change",
  False,
  "Resume even if keys that define the experiment (model, optimiser, RL, env, seed...) differ "
  "from the checkpoint's config; run-only keys (num_steps, cadences, paths, layouts) may always "
  "change.",
)
_MULTIHOST = flags.DEFINE_bool(
  "multihost", False, "Call jax.distributed.initialize() (one process per host or per GPU)."
)
_PEER_TIMEOUT = flags.DEFINE_float(
  "peer_timeout_s",
  30.0,
  "--multihost: seconds without a heartbeat after which a peer counts as lost and this process "
  "exits (status 75) instead of waiting in a collective.",
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f"unexpected arguments: {argv[1:]}; flags are --name=value")
  try:
    cfg = config_lib.from_config_dict(_CONFIG.value)
  except config_lib.ConfigError as e:
    _fail(str(e))  # a bad value fails here, before any device is touched
  import jax  # after the flags: XLA_FLAGS above must be in place first

  from earl_jax import checkpoint, distributed, hostmem
  from earl_jax import workdir as workdir_lib

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

  from earl_jax.rl import loop, loop_stats

  if _MULTIHOST.value:
    # Reads the cluster from the environment (SLURM, TPU pods); a lost peer ends this process
    # within --peer_timeout_s with one line and exit status 75.
    distributed.initialize(peer_timeout_s=_PEER_TIMEOUT.value)
  config_file = pathlib.Path(config_flags.get_config_filename(flags.FLAGS["config"]))
  workdir = _WORKDIR.value or str(_REPO / "runs" / config_file.stem)
  if not jax.config.jax_compilation_cache_dir:  # unless the user chose one (JAX_COMPILATION_...)
    # A restarted or resumed run reuses the programs compiled before instead of compiling again.
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(workdir) / "compile_cache"))
  print(f"config {config_file.name}; workdir {workdir}")
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}")
  print(hostmem.host_line())  # CPU-side timings depend on it
  print(hostmem.malloc_description())
  try:
    trainer = loop.Trainer(cfg, workdir, allow_config_change=_ALLOW_CONFIG_CHANGE.value)
    # The model actually built: with pretrained_path, its config.json's architecture.
    source = cfg.pretrained_path or "the config"
    print(f"model: {trainer.setup.model_cfg.num_params:,} parameters (architecture from {source})")
    baselines = trainer.baselines()
    if baselines:
      print(loop_stats.format_baselines(baselines))
    rows = trainer.run()
  except config_lib.ConfigError as e:
    hint = ""
    if "_layout" in str(e) and jax.devices()[0].platform == "cpu":
      hint = f" (on CPU, --cpu_devices=N simulates N devices; this run has {jax.device_count()})"
    _fail(f"{e}{hint}")
  except (
    workdir_lib.WorkdirError,
    checkpoint.CheckpointError,
    loop.NonFiniteError,
  ) as e:
    _fail(str(e))
  except OSError as e:  # the file system under the workdir (full, read-only, gone)
    _fail(f"{type(e).__name__}: {e}")
  except KeyboardInterrupt:  # a second Ctrl-C (the first saves at the end of the step)
    print(f"earl_jax: interrupted; the run resumes from its last checkpoint in {workdir}")
    sys.exit(130)
  if _MULTIHOST.value:
    distributed.shutdown()  # tells the peers this process ended on purpose
  _say_done(cfg, workdir, rows, finished_before=trainer.start_step >= cfg.train.num_steps)


def _say_done(cfg, workdir: str, rows: list[dict], finished_before: bool) -> None:
  """The run's last lines: nothing to do (a finished run restarted), or the final evaluation."""
  if finished_before and not rows:
    print(
      f"nothing to do: the run in {workdir} already reached train.num_steps={cfg.train.num_steps}"
      " (raise it to train on; --workdir=<new folder> starts afresh)"
    )
  evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
  if evals:
    last = evals[-1]
    print("final evaluation:", {k: round(v, 3) for k, v in last.items() if k.startswith("eval/")})


if __name__ == "__main__":
  app.run(main)
