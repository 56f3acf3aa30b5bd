"""Checkpoints of the training loop: a thin wrapper over ``orbax.checkpoint.CheckpointManager``.

Data flow: ``rl.loop`` calls ``Checkpointer.save`` every ``save_every`` steps with the train state
(params, optimiser state, rng, step, reference params) and a JSON ``meta`` dict (data/env seed
position, the ParallelPlan as JSON, selector profile table, config, metrics step). ``restore``
places the arrays directly onto whatever plan the resumed run chose, given an abstract state of
``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves, so a run may resume on another mesh
or device count without a host gather of the whole model.

On-disk layout of one step (orbax composite, OCDBT): ``state`` holds the arrays as a *flat* dict
keyed by the dotted pytree path (``params.layers.0.attn.wq``), so any pytree type (nnx.State,
optax NamedTuples, dataclasses) saves and restores without orbax knowing the type; ``meta`` holds
the caller's JSON; ``format`` records which leaves were typed PRNG keys. Typed keys
(``jax.random.key``) cannot be serialised by orbax, so they are saved as their raw
``jax.random.key_data`` and rewrapped with ``jax.random.wrap_key_data`` on restore, transparently.

Atomicity comes from orbax: a step is written to a temporary directory and renamed when complete,
so a run killed mid-save leaves the previous complete step as ``latest_step``. A complete step can
still be damaged later (a truncated file, a deleted manifest): ``restore_newest_readable`` reports
it in one line, moves it aside to ``<directory>.damaged/`` (never deletes it) and falls back to the
next older step. A failed background write raises ``CheckpointWriteError`` once, at the next
``check``/``save``/``wait``, naming the step, the path and the cause; the steps already on disk
stay as they were.
"""

from __future__ import annotations

import contextlib
import json
import logging as py_logging
import pathlib
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from earl_jax.types import PyTree

_FORMAT_VERSION = 1
_ITEMS = ("state", "meta", "format")


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or read; the message names the step, the path and why."""


class DamagedCheckpointError(CheckpointError):
  """A step on disk cannot be read (missing or truncated files, unreadable metadata)."""

  def __init__(self, step: int, directory: pathlib.Path, cause: BaseException | str):
    self.step, self.cause = step, cause
    why = cause if isinstance(cause, str) else f"{type(cause).__name__}: {_one_line(cause)}"
    super().__init__(f"checkpoint step {step} in {directory} is unreadable ({why})")


class CheckpointWriteError(CheckpointError):
  """A (background) save failed; the steps already on disk are untouched."""


class CheckpointMismatchError(ValueError):
  """The state asked for differs from the one on disk (keys, shapes, dtypes): a changed model or
  optimiser, not a damaged file, so resume stops instead of falling back to an older step."""


def _one_line(e: BaseException, limit: int = 300) -> str:
  text = " ".join(str(e).split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _path_part(entry: Any) -> str:
  if isinstance(entry, jax.tree_util.DictKey):
    return str(entry.key)
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return entry.name
  if isinstance(entry, jax.tree_util.SequenceKey):
    return str(entry.idx)
  if isinstance(entry, jax.tree_util.FlattenedIndexKey):
    return str(entry.key)
  return str(entry)


def _flatten(tree: PyTree) -> tuple[dict[str, Any], Any]:
  """Flat ``{dotted path: leaf}`` dict and the treedef; raises if two paths collide."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  flat: dict[str, Any] = {}
  for path, leaf in leaves_with_path:
    name = ".".join(_path_part(p) for p in path) or "_root"
    if name in flat:
      raise ValueError(f"two state leaves map to the checkpoint key {name!r}; rename one of them")
    flat[name] = leaf
  return flat, treedef


def flat_names(tree: PyTree) -> list[str]:
  """The checkpoint key of each leaf of ``tree`` (dotted pytree paths), in leaf order."""
  return list(_flatten(tree)[0])


def _is_prng_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_abstract(name: str, leaf: Any) -> jax.ShapeDtypeStruct:
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  if isinstance(leaf, jax.ShapeDtypeStruct):
    if leaf.sharding is None:
      raise ValueError(
        f"abstract_state leaf {name!r} has no sharding; build it as "
        "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))"
      )
    return leaf
  raise TypeError(
    f"abstract_state leaf {name!r} is a {type(leaf).__name__}; expected jax.ShapeDtypeStruct "
    "with a sharding (or a jax.Array, whose shape, dtype and sharding are used)"
  )


class _OrbaxErrorsInOneLine(py_logging.Filter):
  """Drops the traceback orbax logs (several times) for a failed save or read; the failure
  reaches the caller once, as a CheckpointWriteError or DamagedCheckpointError with the cause."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.exc_info and "orbax" in record.pathname:
      record.exc_info, record.exc_text = None, None
    return True


_ORBAX_FILTER = _OrbaxErrorsInOneLine()


def _drop_late_io_callbacks(previous: Callable[[Any], None]) -> Callable[[Any], None]:
  """An unraisable hook that drops "Event loop is closed" from tensorstore reads and writes that
  finish after the orbax operation they belonged to failed and closed its event loop (one
  traceback per pending chunk, hundreds on a full disk); the failure itself is reported by the
  CheckpointWriteError / DamagedCheckpointError raised for that operation."""

  def hook(unraisable: Any) -> None:
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
      return
    previous(unraisable)

  hook._earl_jax = True  # type: ignore[attr-defined]
  return hook


def _install_hooks() -> None:
  logging.get_absl_logger().addFilter(_ORBAX_FILTER)  # a filter is added once
  if not getattr(sys.unraisablehook, "_earl_jax", False):
    sys.unraisablehook = _drop_late_io_callbacks(sys.unraisablehook)


class Checkpointer:
  """Saves every ``save_every`` steps (or when forced), keeps the last ``keep``, restores anywhere.

  Saves are asynchronous by default: ``save`` returns once the arrays are copied off the devices
  (so the caller may donate or overwrite them in the next step) and the files are written in the
  background; ``wait`` blocks until the last save is on disk. A save at a step that is already on
  disk (a resumed run reaching its restored step again) is skipped and returns False.
  """

  def __init__(
    self,
    directory: str | pathlib.Path,
    *,
    save_every: int,
    keep: int,
    async_save: bool = True,
  ) -> None:
    self.directory = pathlib.Path(directory).absolute()
    if self.directory.exists() and not self.directory.is_dir():
      raise NotADirectoryError(
        f"checkpoint directory {self.directory} exists and is not a directory; "
        "pass a directory path (it is created if missing)"
      )
    if save_every < 1:
      raise ValueError(f"save_every must be >= 1, got {save_every}")
    if keep < 1:
      raise ValueError(f"keep must be >= 1 (number of checkpoints kept), got {keep}")
    self.save_every = save_every
    self.keep = keep
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save, create=True
    )
    handlers = {
      "state": ocp.StandardCheckpointHandler(),
      "meta": ocp.JsonCheckpointHandler(),
      "format": ocp.JsonCheckpointHandler(),
    }
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    _install_hooks()
    self._writing: int | None = None  # the step of the last save started
    self._write_failed = False  # a write error was raised once; later waits do not repeat it

  @property
  def damaged_directory(self) -> pathlib.Path:
    """Where unreadable steps are moved: ``<directory>.damaged/<step>[-<unix time>]``."""
    return self.directory.with_name(self.directory.name + ".damaged")

  def _write_error(self, e: BaseException) -> CheckpointWriteError:
    self._write_failed = True
    kept = [s for s in self._manager.all_steps() if s != self._writing]
    return CheckpointWriteError(
      f"writing checkpoint step {self._writing} to {self.directory} failed: "
      f"{type(e).__name__}: {_one_line(e)}; steps on disk ({sorted(kept) or 'none'}) are intact"
    )

  def check(self) -> None:
    """Raises ``CheckpointWriteError`` (once) if a background save has failed; never blocks on a
    save still in progress."""
    if self._write_failed or self._manager.is_saving_in_progress():
      return
    self.wait()  # the save is finished: returns at once, or raises its error

  def should_save(self, step: int, *, force: bool = False) -> bool:
    """Whether ``save(step, force=force)`` would write (cadence and not already on disk)."""
    return (force or step % self.save_every == 0) and step not in self._manager.all_steps()

  def save(self, step: int, *, state: PyTree, meta: Mapping[str, Any], force: bool = False) -> bool:
    """Starts saving ``state`` and ``meta`` at ``step`` if due; returns whether a save started."""
    if not isinstance(step, int) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")
    self.check()
    if self._write_failed:
      raise CheckpointWriteError(
        f"not saving step {step}: the write of step {self._writing} to {self.directory} failed "
        "earlier; open a new Checkpointer once the cause is fixed"
      )
    if not self.should_save(step, force=force):
      return False
    try:
      meta_json = json.loads(json.dumps(dict(meta)))
    except (TypeError, ValueError) as e:
      raise TypeError(f"checkpoint meta must be JSON-serialisable (dict of str keys): {e}") from e
    flat, _ = _flatten(state)
    prng_impls = {}
    for name, leaf in flat.items():
      if _is_prng_key(leaf):
        prng_impls[name] = str(jax.random.key_impl(leaf))
        flat[name] = jax.random.key_data(leaf)
    fmt = {"version": _FORMAT_VERSION, "prng_keys": prng_impls}
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(flat),
      meta=ocp.args.JsonSave(meta_json),
      format=ocp.args.JsonSave(fmt),
    )
    # Cadence is decided above, so orbax's own save-interval policy is bypassed with force=True.
    self._writing = step
    try:
      return bool(self._manager.save(step, args=args, force=True))
    except Exception as e:  # a synchronous part of the write failed
      raise self._write_error(e) from e

  def wait(self) -> None:
    """Blocks until every started save is complete on disk; raises a write error once."""
    try:
      self._manager.wait_until_finished()
      if not self._write_failed:
        self._manager.check_for_errors()
    except Exception as e:  # reported with its cause, once
      if self._write_failed:
        return
      raise self._write_error(e) from e

  def latest_step(self) -> int | None:
    """The newest complete step on disk, or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every complete step on disk, ascending."""
    return sorted(self._manager.all_steps())

  def restore(
    self, step: int | None = None, *, abstract_state: PyTree
  ) -> tuple[PyTree, dict[str, Any]]:
    """Restores ``(state, meta)`` from ``step`` (default: latest) onto ``abstract_state``'s layout.

    Args:
      step: the step to restore; None means ``latest_step()``.
      abstract_state: the pytree the state should come back as, with ``jax.ShapeDtypeStruct``
        leaves carrying the target sharding (jax.Array leaves are read as their own shape, dtype
        and sharding). Typed PRNG key leaves use the key dtype (``jax.eval_shape`` of the init).

    Raises:
      FileNotFoundError: no checkpoint (or not this step) in the directory.
      CheckpointMismatchError: the abstract state's keys, shapes or dtypes differ from the disk.
      DamagedCheckpointError: the step's files cannot be read.
    """
    self.wait()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint found in {self.directory}")
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(
        f"no checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}"
      )
    with self._reading(step):
      fmt = self._manager.restore(step, args=ocp.args.Composite(format=ocp.args.JsonRestore()))
      prng_impls: dict[str, str] = dict(fmt["format"]["prng_keys"])
    flat_abstract, treedef = _flatten(abstract_state)
    wanted = {}
    for name, leaf in flat_abstract.items():
      leaf = _to_abstract(name, leaf)
      flat_abstract[name] = leaf
      if _is_prng_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        leaf = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=leaf.sharding)
      wanted[name] = leaf
    with self._reading(step):
      on_disk, _ = _flatten(self._manager.item_metadata(step)["state"].tree)
    self._check_matches(step, wanted, flat_abstract, prng_impls, on_disk)
    with self._reading(step):
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(wanted), meta=ocp.args.JsonRestore()
        ),
      )
      meta = self._valid_meta(step, restored["meta"])
    flat_state = dict(restored["state"])
    for name in prng_impls:
      flat_state[name] = jax.random.wrap_key_data(flat_state[name], impl=prng_impls[name])
    leaves = [flat_state[name] for name in flat_abstract]
    return jax.tree_util.tree_unflatten(treedef, leaves), meta

  @contextlib.contextmanager
  def _reading(self, step: int) -> Iterator[None]:
    """Any failure to read ``step`` inside becomes a DamagedCheckpointError."""
    try:
      yield
    except (CheckpointError, CheckpointMismatchError):
      raise
    except Exception as e:  # whatever orbax/tensorstore raise for a bad file
      raise DamagedCheckpointError(step, self.directory, e) from e

  def _valid_meta(self, step: int, meta: Any) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
      raise DamagedCheckpointError(step, self.directory, f"meta is a {type(meta).__name__}")
    if "step" in meta and meta["step"] != step:
      raise DamagedCheckpointError(step, self.directory, f"meta says step {meta['step']}")
    return dict(meta)

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON ``meta`` saved with ``step`` (no arrays are read); DamagedCheckpointError if the
    file is missing or unreadable."""
    with self._reading(step):
      restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      return self._valid_meta(step, restored["meta"])

  def restore_arrays(self, step: int, wanted: Mapping[str, jax.ShapeDtypeStruct]) -> dict:
    """Some arrays of ``step``'s state, by checkpoint key (``flat_names``), each onto the
    sharding of its ``jax.ShapeDtypeStruct``; nothing else is read. For readers that hold one
    parameter at a time (the HF export)."""
    with self._reading(step):
      on_disk, _ = _flatten(self._manager.item_metadata(step)["state"].tree)
    problems = [
      f"{k}: saved {on_disk[k].dtype}{list(on_disk[k].shape)}, asked {v.dtype}{list(v.shape)}"
      for k, v in wanted.items()
      if k in on_disk
      and (tuple(v.shape), jnp.dtype(v.dtype))
      != (
        tuple(on_disk[k].shape),
        jnp.dtype(on_disk[k].dtype),
      )
    ]
    missing = sorted(set(wanted) - set(on_disk))
    if missing or problems:
      raise CheckpointMismatchError(
        f"checkpoint step {step} in {self.directory}: "
        + "; ".join(([f"not in the checkpoint: {missing}"] if missing else []) + problems)
      )
    item = dict(wanted)
    args = ocp.args.PyTreeRestore(
      item=item,
      restore_args=ocp.checkpoint_utils.construct_restore_args(item),
      partial_restore=True,
    )
    with self._reading(step):
      reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
      return dict(reader.restore(self.directory / str(step) / "state", args=args))

  def restore_newest_readable(
    self,
    *,
    abstract_state: PyTree,
    check_meta: Callable[[int, dict[str, Any]], None] | None = None,
  ) -> tuple[PyTree, dict[str, Any], list[int]]:
    """Restores the newest step that reads back; unreadable newer steps are moved aside.

    Each unreadable step is reported in one warning line (step, cause, where it was moved) and
    moved to ``damaged_directory`` (process 0 moves, every process waits for it), then the next
    older step is tried. ``check_meta(step, meta)`` runs on each candidate's meta before its
    arrays are read; what it raises (a changed config) propagates and nothing is moved.

    Returns:
      ``(state, meta, damaged_steps)``.

    Raises:
      FileNotFoundError: no checkpoint at all in the directory.
      CheckpointError: checkpoints exist but none is readable (names the directory and causes).
      CheckpointMismatchError: the newest readable step holds another state layout.
    """
    self.wait()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint found in {self.directory}")
    damaged: list[DamagedCheckpointError] = []
    for step in reversed(steps):
      try:
        meta = self.read_meta(step)
        if check_meta is not None:
          check_meta(step, meta)
        state, meta = self.restore(step, abstract_state=abstract_state)
      except DamagedCheckpointError as e:
        damaged.append(e)
        self._move_aside(e)
        continue
      return state, meta, [e.step for e in damaged]
    raise CheckpointError(
      f"no readable checkpoint in {self.directory} (steps {steps} are damaged and were moved to "
      f"{self.damaged_directory}): " + "; ".join(f"step {e.step}: {e.cause}" for e in damaged)
    )

  def _move_aside(self, error: DamagedCheckpointError) -> None:
    source = self.directory / str(error.step)
    target = self.damaged_directory / str(error.step)
    if jax.process_index() == 0:
      self.damaged_directory.mkdir(parents=True, exist_ok=True)
      if target.exists():
        target = target.with_name(f"{error.step}-{int(time.time())}")
      shutil.move(str(source), str(target))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"earl_jax_damaged_checkpoint_{error.step}")
    self._manager.reload()
    logging.warning("%s; moved to %s, trying the next older step", error, target)

  def _check_matches(
    self,
    step: int,
    wanted: dict[str, jax.ShapeDtypeStruct],
    flat_abstract: dict[str, jax.ShapeDtypeStruct],
    prng_impls: dict[str, str],
    on_disk: dict[str, Any],
  ) -> None:
    """Raises one CheckpointMismatchError listing every key, shape, dtype or key-type mismatch."""
    problems = []
    missing, extra = sorted(set(wanted) - set(on_disk)), sorted(set(on_disk) - set(wanted))
    if missing:
      problems.append(f"not in the checkpoint: {missing}")
    if extra:
      problems.append(f"in the checkpoint but not in abstract_state: {extra}")
    for name in sorted(set(wanted) & set(on_disk)):
      want, have = wanted[name], on_disk[name]
      if tuple(want.shape) != tuple(have.shape) or jnp.dtype(want.dtype) != jnp.dtype(have.dtype):
        problems.append(
          f"{name}: saved {have.dtype}{list(have.shape)}, asked {want.dtype}{list(want.shape)}"
        )
      if _is_prng_key(flat_abstract[name]) != (name in prng_impls):
        problems.append(
          f"{name}: typed PRNG key on one side only (saved as key: {name in prng_impls})"
        )
    if problems:
      raise CheckpointMismatchError(
        f"abstract_state does not match checkpoint step {step} in {self.directory}: "
        + "; ".join(problems)
      )

  def close(self) -> None:
    """Waits for pending saves and releases orbax's background resources (a write error not yet
    reported is raised after the resources are released)."""
    try:
      self.wait()
    finally:
      try:
        self._manager.close()
      except Exception:  # a failed write was reported (or is being raised) above
        if not self._write_failed:
          raise

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()
