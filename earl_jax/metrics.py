"""Host-side metrics of the training loop: JSONL + TensorBoard (+ optional W&B) writers, timers.

Data flow: ``rl.loop`` reduces each step's device metrics to a few host scalars and calls
``MetricsWriter.write(step, scalars)``; structured events (selector decisions, plan changes) go
through ``write_event``. ``launch/plot.py`` reads the files back with ``read_metrics`` /
``read_events``. Files in ``workdir``: ``metrics.jsonl`` and ``events.jsonl`` (one JSON object a
line, flushed per write so a killed run keeps every complete line) and ``tb/`` (event files).

Metric names shared by the loop, the progress bar and the plots (use these keys):
  ``reward/mean`` (and ``reward/*``), ``win_rate`` (games) or ``correct_rate`` (the calculator),
  ``eval/<suite>/win_rate`` or ``eval/<suite>/correct_rate``,
  ``context_len/mean``, ``context_len/max``, ``time/<stage>`` (seconds, from ``StageTimer``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import tqdm

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
TB_DIR = "tb"
REWARD_KEY = "reward/mean"
REWARD_STD_KEY = "reward/std"  # plotted on its own axis, not the reward's
WIN_RATE_KEY = "win_rate"
CORRECT_RATE_KEY = "correct_rate"  # the calculator's headline rate (games: win_rate)
CONTEXT_MEAN_KEY = "context_len/mean"
CONTEXT_MAX_KEY = "context_len/max"
TIME_PREFIX = "time/"
EVAL_PREFIX = "eval/"
WIN_RATE_SUFFIX = "/win_rate"
SUCCESS_SUFFIXES = (WIN_RATE_SUFFIX, "/" + CORRECT_RATE_KEY)  # eval/<suite>/<headline rate>
_RESERVED = ("step", "time")


def _to_python(key: str, value: Any) -> float | int:
  """A Python number from a float/int/bool, numpy scalar or 0-d (jax or numpy) array."""
  if isinstance(value, bool | int | float):
    return value if not isinstance(value, bool) else int(value)
  array = np.asarray(value)  # Also fetches a jax.Array from its device.
  if array.ndim != 0 or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
    raise ValueError(
      f"metric {key!r} must be a number or a 0-d numeric array, got {type(value).__name__} "
      f"with shape {array.shape} and dtype {array.dtype}; reduce it (e.g. .mean()) first"
    )
  item = array.item()
  return int(item) if isinstance(item, bool) else item


def _json_default(value: Any) -> Any:
  """Lets event payloads carry numpy/jax scalars and small arrays."""
  if isinstance(value, np.generic):
    return value.item()
  if hasattr(value, "__array__"):
    return np.asarray(value).tolist()
  raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _truncate_jsonl(path: pathlib.Path, resume_step: int | None) -> None:
  """Drops a torn last line and, when resuming, every line with step > resume_step."""
  if not path.exists():
    return
  text = path.read_text()
  lines = text.split("\n")
  complete = lines[:-1]  # The part after the last newline is empty or a torn write.
  if resume_step is not None:
    kept = []
    for i, line in enumerate(complete):
      try:
        if line.strip() and json.loads(line)["step"] <= resume_step:
          kept.append(line)
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:{i + 1} is not a JSON line with a 'step': {e!r}") from e
    complete = kept
  new_text = "".join(line + "\n" for line in complete)
  if new_text != text:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(new_text)
    os.replace(tmp, path)  # Atomic: a crash here leaves either the old or the new file.


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  rows = []
  text = path.read_text()
  lines = text.split("\n")
  for i, line in enumerate(lines[:-1] if not text.endswith("\n") else lines):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{i + 1} is not a JSON line: {e}") from e
  return rows


class MetricsWriter:
  """Appends scalars to ``metrics.jsonl``, events to ``events.jsonl``, and mirrors to TB / W&B.

  Args:
    workdir: output directory (created if missing).
    tensorboard: also write TensorBoard scalars to ``workdir/tb``.
    wandb_project: log to Weights & Biases under this project when non-empty; wandb must then be
      installed (an ImportError is raised here otherwise, never a silent skip).
    config: run config (JSON-able), given to W&B.
    resume_step: when resuming, lines (and TB points) with step > resume_step are dropped so the
      resumed run does not duplicate steps. None keeps existing files as they are and appends.
  """

  def __init__(
    self,
    workdir: str | pathlib.Path,
    *,
    tensorboard: bool = True,
    wandb_project: str = "",
    config: Mapping[str, Any] | None = None,
    resume_step: int | None = None,
  ) -> None:
    self.workdir = pathlib.Path(workdir)
    if self.workdir.exists() and not self.workdir.is_dir():
      raise NotADirectoryError(f"metrics workdir {self.workdir} exists and is not a directory")
    self.workdir.mkdir(parents=True, exist_ok=True)
    self._wandb = None
    if wandb_project:
      try:
        import wandb  # Optional dependency, imported only when asked for.
      except ImportError as e:
        raise ImportError(
          f"wandb_project={wandb_project!r} is set but wandb is not installed; "
          "`pip install wandb` or set wandb_project=''"
        ) from e
      self._wandb = wandb.init(
        project=wandb_project, config=dict(config or {}), dir=str(self.workdir), resume="allow"
      )
    for name in (METRICS_FILE, EVENTS_FILE):
      _truncate_jsonl(self.workdir / name, resume_step)
    self._metrics = open(self.workdir / METRICS_FILE, "a")  # noqa: SIM115 (closed in close())
    self._events = open(self.workdir / EVENTS_FILE, "a")  # noqa: SIM115
    self._tb = None
    if tensorboard:
      import tensorboardX  # Lazy: readers and plots need no protobuf.

      # purge_step makes TensorBoard hide points of the first run at steps >= the resumed step.
      purge = None if resume_step is None else resume_step + 1
      self._tb = tensorboardX.SummaryWriter(str(self.workdir / TB_DIR), purge_step=purge)

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Appends one line ``{"step", "time", **scalars}`` and mirrors it to TensorBoard / W&B."""
    values = {}
    for key, value in scalars.items():
      if not isinstance(key, str) or key in _RESERVED:
        raise ValueError(f"metric key {key!r} must be a str other than {_RESERVED}")
      values[key] = _to_python(key, value)
    row = {"step": int(step), "time": time.time(), **values}
    self._metrics.write(json.dumps(row) + "\n")
    self._metrics.flush()
    if self._tb is not None:
      for key, value in values.items():
        self._tb.add_scalar(key, value, global_step=int(step))
      self._tb.flush()
    if self._wandb is not None:
      self._wandb.log(values, step=int(step))

  def write_event(self, step: int, kind: str, payload: Mapping[str, Any]) -> None:
    """Appends one line ``{"step", "time", "kind", **payload}`` to ``events.jsonl``."""
    clash = sorted(set(payload) & {"step", "time", "kind"})
    if clash:
      raise ValueError(f"event payload keys {clash} are reserved (step, time, kind)")
    row = {"step": int(step), "time": time.time(), "kind": kind, **payload}
    try:
      line = json.dumps(row, default=_json_default)
    except TypeError as e:
      raise TypeError(f"event {kind!r} payload is not JSON-serialisable: {e}") from e
    self._events.write(line + "\n")
    self._events.flush()

  def close(self) -> None:
    """Flushes and closes every writer (idempotent)."""
    for f in (self._metrics, self._events):
      if not f.closed:
        f.close()
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def read_metrics(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
  """Every metrics line of ``workdir`` in file order; FileNotFoundError if there is no file."""
  path = pathlib.Path(workdir) / METRICS_FILE
  if not path.is_file():
    raise FileNotFoundError(f"no {METRICS_FILE} in {workdir} (is it the run's workdir?)")
  return _read_jsonl(path)


def read_events(workdir: str | pathlib.Path, kind: str | None = None) -> list[dict[str, Any]]:
  """Event lines of ``workdir`` (only those of ``kind`` if given); [] when none were written."""
  path = pathlib.Path(workdir) / EVENTS_FILE
  if not path.is_file():
    return []
  return [e for e in _read_jsonl(path) if kind is None or e.get("kind") == kind]


class StageTimer:
  """Host wall seconds per stage within one step: ``with timer("rollout"): ...``.

  JAX dispatches asynchronously: a block that launches device work and does not wait for it is
  charged only the dispatch, and the device time shows in the next block that waits (the loop
  waits only in the rollout, so an update's time lands in the next step's rollout). Wrap with
  ``jax.block_until_ready`` to time one stage on its own. Entering the same stage twice in a step
  adds up. ``summary()`` returns ``{"time/<stage>": seconds}``; ``reset()`` (or
  ``summary(reset=True)``) starts the next step.
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
    self._clock = clock
    self._totals: dict[str, float] = {}
    self._running: set[str] = set()

  @contextlib.contextmanager
  def __call__(self, stage: str) -> Iterator[None]:
    if stage in self._running:
      raise RuntimeError(f"stage {stage!r} is already being timed (nested with itself)")
    self._running.add(stage)
    start = self._clock()
    try:
      yield
    finally:
      self._running.discard(stage)
      self._totals[stage] = self._totals.get(stage, 0.0) + (self._clock() - start)

  def summary(self, *, reset: bool = False) -> dict[str, float]:
    """``{"time/<stage>": seconds}`` for the stages timed since the last reset."""
    out = {TIME_PREFIX + stage: seconds for stage, seconds in self._totals.items()}
    if reset:
      self.reset()
    return out

  def reset(self) -> None:
    self._totals = {}


def format_scalars(scalars: Mapping[str, Any]) -> str:
  """Compact progress text of the keys present: reward, win rates, context length, stage times."""
  parts = []
  if REWARD_KEY in scalars:
    parts.append(f"rew {float(scalars[REWARD_KEY]):.3f}")
  for key, short in ((WIN_RATE_KEY, "win"), (CORRECT_RATE_KEY, "correct")):
    if key in scalars:
      parts.append(f"{short} {float(scalars[key]):.2f}")
  for key in sorted(scalars):
    for suffix in SUCCESS_SUFFIXES:
      if key.startswith(EVAL_PREFIX) and key.endswith(suffix):
        suite = key[len(EVAL_PREFIX) : -len(suffix)]
        parts.append(f"{suffix[1:].split('_')[0]}[{suite}] {float(scalars[key]):.2f}")
  if CONTEXT_MEAN_KEY in scalars or CONTEXT_MAX_KEY in scalars:
    mean, peak = scalars.get(CONTEXT_MEAN_KEY), scalars.get(CONTEXT_MAX_KEY)
    text = "/".join(f"{float(v):.0f}" for v in (mean, peak) if v is not None)
    parts.append(f"ctx {text}")
  times = [
    (k[len(TIME_PREFIX) :], float(v)) for k, v in scalars.items() if k.startswith(TIME_PREFIX)
  ]
  if times:
    parts.append(" ".join(f"{stage} {seconds:.2f}s" for stage, seconds in times))
  return " | ".join(parts)


class Progress:
  """A tqdm bar over training steps whose postfix shows ``format_scalars`` of the last update."""

  def __init__(self, total_steps: int, initial: int = 0, **tqdm_kwargs: Any) -> None:
    self._bar = tqdm.tqdm(
      total=total_steps, initial=initial, unit="step", dynamic_ncols=True, **tqdm_kwargs
    )

  @property
  def n(self) -> int:
    return self._bar.n

  def update(self, step: int, scalars: Mapping[str, Any] | None = None) -> None:
    """Moves the bar to ``step`` (the number of steps done) and shows the scalars."""
    if scalars:
      self._bar.set_postfix_str(format_scalars(scalars), refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self) -> None:
    self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


class ProfileWindow:
  """Writes a ``jax.profiler`` trace of the steps in ``steps`` to ``<directory>/plugins/profile/``
  (open with TensorBoard's profile plugin or Perfetto). ``begin(step)`` / ``end(step)`` bracket a
  step; a trace spans consecutive listed steps, and a run that stops mid-window still ends it."""

  def __init__(self, steps: tuple[int, ...], directory: str | os.PathLike[str]):
    if any(s < 0 for s in steps):
      raise ValueError(f"profile steps must be >= 0, got {steps}")
    self.steps, self.directory = frozenset(steps), os.fspath(directory)
    self._tracing = False

  def begin(self, step: int) -> None:
    if step in self.steps and not self._tracing:
      import jax  # only when a trace is asked for

      jax.profiler.start_trace(self.directory)
      self._tracing = True

  def end(self, step: int) -> None:
    if self._tracing and step + 1 not in self.steps:
      self.close()

  def close(self) -> None:
    if self._tracing:
      import jax

      jax.profiler.stop_trace()
      self._tracing = False
