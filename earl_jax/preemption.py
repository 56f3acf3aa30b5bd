"""Preemption: SIGTERM (and Ctrl-C) set a flag the training loop reads once per step (then it
saves and exits at a step boundary) instead of killing the process mid-step or mid-save. A second
Ctrl-C does not wait: it raises ``KeyboardInterrupt`` at once (the launcher exits quietly; the
last finished checkpoint is where the run resumes)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

_preempted = threading.Event()
_received: list[str] = []  # the names of the signals that set the flag


def install_preemption_handler(
  callback: Callable[[int], None] | None = None,
  signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
) -> Callable[[], None]:
  """Makes SIGTERM (by default) set the flag read by ``preempted()`` instead of killing the process.

  The loop checks ``preempted()`` once per step and, when set, saves with ``force=True``, waits and
  exits: saving inside the handler itself is unsafe because the signal may arrive in the middle of
  a save or of a jitted step. ``callback(signum)``, if given, runs in the handler (on the main
  thread) after the flag is set and should only record things. Must be called from the main
  thread (a Python rule for signal handlers). With several processes each reads its own flag;
  the loop all-gathers them once per step, so every process saves the same step.

  Returns:
    A function that restores the previous handlers and clears the flag.
  """

  def handler(signum: int, frame: object) -> None:
    del frame
    if signum == signal.SIGINT and _preempted.is_set():
      raise KeyboardInterrupt  # the second Ctrl-C: stop now, do not wait for the step
    _received.append(signal.Signals(signum).name)
    _preempted.set()
    if callback is not None:
      callback(signum)

  previous = {s: signal.signal(s, handler) for s in signals}

  def uninstall() -> None:
    for s, old in previous.items():
      signal.signal(s, old)
    _preempted.clear()
    _received.clear()

  return uninstall


def preempted() -> bool:
  """True once a signal handled by ``install_preemption_handler`` has arrived."""
  return _preempted.is_set()


def received() -> str:
  """The signals that asked to stop, e.g. ``"SIGINT"``; "" if none did."""
  return "+".join(dict.fromkeys(_received))
