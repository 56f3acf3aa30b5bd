"""Multi-process runs: a bounded wait for a lost peer, and a clear exit when one is lost.

When a process of a multi-host job dies, the others block in their next collective until the JAX
distributed runtime notices the missing heartbeats and aborts them with a C++ stack trace
(SIGABRT). ``initialize`` starts a small watchdog thread in every process instead: each process
bumps its own counter in the coordination service's key-value store every ``interval_s``; a peer
whose counter has not moved for ``peer_timeout_s`` (measured on the local clock, so host clocks
need not agree), or a coordination service that no longer answers, makes the survivors print one
line naming the lost process and exit with status ``EXIT_PEER_LOST`` (75), ``peer_timeout_s`` +
``interval_s`` after the loss at most. The runtime's own heartbeat timeout is set well above, so
the watchdog reports first. Checkpoints are atomic: the run resumes from its newest complete one.

Only this module touches JAX's distributed client (``jax._src.distributed.global_state``), which
has no public accessor.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time

import jax

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: the job may be restarted and resumes from its checkpoint
PEER_TIMEOUT_S = 30.0
_KEY = "earl_jax/alive/{}"
_DONE = "done"


def _client():
  from jax._src import distributed as jax_distributed  # no public accessor for the client

  return jax_distributed.global_state.client


class PeerWatchdog:
  """Heartbeats of this process and checks of every other one, on a daemon thread."""

  def __init__(
    self,
    client,
    process_index: int,
    num_processes: int,
    *,
    peer_timeout_s: float = PEER_TIMEOUT_S,
    interval_s: float = 1.0,
    on_lost=None,
  ):
    self.client, self.me, self.n = client, process_index, num_processes
    self.peer_timeout_s, self.interval_s = peer_timeout_s, interval_s
    self.on_lost = on_lost or functools.partial(_exit_peer_lost, process_index)
    self._stop = threading.Event()
    self._beats = 0
    self._thread = threading.Thread(target=self._run, name="earl_jax_peer_watchdog", daemon=True)

  def start(self) -> PeerWatchdog:
    self._beat()
    self._thread.start()
    return self

  def stop(self, *, done: bool = True) -> None:
    """Stops watching; ``done`` tells the peers this process ended on purpose."""
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=10)
    if done:
      # The service may already be gone at the very end of a run.
      with contextlib.suppress(Exception):
        self.client.key_value_set(_KEY.format(self.me), _DONE, allow_overwrite=True)

  def _beat(self) -> None:
    self._beats += 1
    self.client.key_value_set(_KEY.format(self.me), str(self._beats), allow_overwrite=True)

  def _run(self) -> None:
    try:
      self._watch()
    except BaseException as e:  # the watchdog must not die silently
      if not self._stop.is_set():
        self.on_lost(-1, f"the peer watchdog failed: {_short(e)}")

  def _watch(self) -> None:
    seen: dict[int, tuple[str, float]] = {}
    while not self._stop.wait(self.interval_s):
      now = time.monotonic()
      try:
        self._beat()
        values = {p: self._value(p) for p in range(self.n) if p != self.me}
      except Exception as e:
        if not self._stop.is_set():
          self.on_lost(0, f"the coordination service (process 0) does not answer: {_short(e)}")
        return
      for peer, value in values.items():
        if value == _DONE:
          continue
        last_value, since = seen.get(peer, (None, now))
        if value != last_value:
          seen[peer] = (value, now)
        elif now - since > self.peer_timeout_s:
          self.on_lost(peer, f"no heartbeat for {now - since:.0f} s")
          return

  def _value(self, peer: int) -> str | None:
    try:
      return self.client.key_value_try_get(_KEY.format(peer))
    except Exception as e:  # not written yet: NOT_FOUND; anything else is the service failing
      if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
        return None
      raise


def _short(e: BaseException) -> str:
  return " ".join(f"{type(e).__name__}: {e}".split())[:200]


def _exit_peer_lost(me: int, peer: int, why: str) -> None:
  """Ends this process. Touches no JAX API: after a peer's loss the runtime may be half torn
  down (a failed collective on the main thread, the interpreter exiting)."""
  who = f"process {peer} of the run" if peer >= 0 else "contact with the other processes"
  try:
    sys.stderr.write(
      f"\nearl_jax: process {me} stops: lost {who} ({why}). Restart the job; "
      f"it resumes from the newest complete checkpoint (exit status {EXIT_PEER_LOST}).\n"
    )
    sys.stderr.flush()
  finally:
    os._exit(EXIT_PEER_LOST)  # the main thread may be blocked in a collective that never returns


_watchdog: PeerWatchdog | None = None


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  peer_timeout_s: float = PEER_TIMEOUT_S,
) -> None:
  """``jax.distributed.initialize`` (arguments as there; None reads the cluster from the
  environment), then the peer watchdog. A lost peer ends this process within
  ``peer_timeout_s`` + 1 s with one line on stderr and exit status ``EXIT_PEER_LOST``."""
  global _watchdog
  jax.distributed.initialize(
    coordinator_address,
    num_processes,
    process_id,
    heartbeat_timeout_seconds=int(3 * peer_timeout_s + 30),  # the watchdog reports first
  )
  if jax.process_count() > 1:
    _watchdog = PeerWatchdog(
      _client(), jax.process_index(), jax.process_count(), peer_timeout_s=peer_timeout_s
    ).start()


def shutdown() -> None:
  """Tells the peers this process is done, then ``jax.distributed.shutdown``."""
  global _watchdog
  if _watchdog is not None:
    _watchdog.stop(done=True)
    _watchdog = None
  jax.distributed.shutdown()
