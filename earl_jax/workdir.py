"""The run directory: checked writable before any device work, and locked for the run's life.

One trainer per workdir: ``WorkdirLock`` takes an exclusive ``flock`` on ``<workdir>/.lock``
(``.lock.process_<i>`` for the other processes of a multi-host run, so each process of one run has
its own and a second run collides on all of them). The kernel drops the lock when its holder dies,
however it dies, so a stale lock file of a dead process never blocks a new run; its host and pid
are read back only to name the holder in the error, and to log that a stale one was replaced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import socket
import tempfile
import time

from absl import logging


class WorkdirError(RuntimeError):
  """The workdir cannot be used (not writable, or held by another run); the message says why."""


def check_writable(workdir: str | pathlib.Path) -> pathlib.Path:
  """Creates ``workdir`` if needed and proves it writable by writing and removing a probe file.

  Raises:
    WorkdirError: naming the directory and the OS's reason (read-only, permission, full disk).
  """
  if "://" in str(workdir):
    raise WorkdirError(
      f"workdir {str(workdir)!r} is a URL; checkpoints, metrics and the run's lock are written "
      "with file-system calls: pass a directory every process can see (local, NFS, or a "
      "gcsfuse mount of the bucket)"
    )
  path = pathlib.Path(workdir).absolute()
  try:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write_probe_") as probe:
      probe.write(b"earl_jax")
      probe.flush()
      os.fsync(probe.fileno())
  except OSError as e:
    raise WorkdirError(
      f"workdir {path} is not writable ({e.strerror or e}); pass a writable --workdir"
    ) from None
  return path


def _holder(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text() or "{}")
  except (OSError, ValueError):
    return {}


def _describe(holder: dict) -> str:
  if not holder:
    return "another process (no holder recorded)"
  since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
  return f"pid {holder.get('pid')} on host {holder.get('host')} since {since}"


class WorkdirLock:
  """An exclusive lock on a workdir, held until ``release`` (or the process ends).

  Use as a context manager or call ``acquire``/``release``. ``acquire`` never waits: a workdir
  held by a live run raises ``WorkdirError`` at once with the holder's host and pid.
  """

  def __init__(self, workdir: str | pathlib.Path, process_index: int = 0):
    name = ".lock" if process_index == 0 else f".lock.process_{process_index}"
    self.path = pathlib.Path(workdir).absolute() / name
    self._fd: int | None = None

  @property
  def held(self) -> bool:
    return self._fd is not None

  def acquire(self) -> WorkdirLock:
    if self._fd is not None:
      return self
    self.path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        logging.warning(
          "workdir %s: its file system has no locks (%s); a second run on it is not stopped",
          self.path.parent,
          e.strerror,
        )
        self._fd = fd
        return self
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise WorkdirError(f"cannot lock workdir {self.path.parent}: {e.strerror or e}") from None
      holder = _holder(self.path)
      hint = "stop that run or pass another --workdir"
      if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        hint = "it is this process: close() the earlier Trainer first, or use another workdir"
      raise WorkdirError(
        f"workdir {self.path.parent} is in use by {_describe(holder)} (lock {self.path}); {hint}"
      ) from None
    previous = _holder(self.path)  # a clean release empties the file: a record left is stale
    if previous:
      logging.warning(
        "workdir lock: took over the stale lock of %s (it ended without releasing)",
        _describe(previous),
      )
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)  # no holder recorded: the next run sees a clean lock
    finally:
      with contextlib.suppress(OSError):  # a file system without locks had none to drop
        fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc: object) -> None:
    self.release()

  def __del__(self, _close=os.close) -> None:  # bound now: at interpreter exit `os` may be gone
    if self._fd is not None:
      _close(self._fd)  # the kernel drops the flock with its last descriptor
