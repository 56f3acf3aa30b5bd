"""The lost-peer watchdog, with an in-memory key-value store standing in for JAX's service."""

import threading
import time

from earl_jax import distributed


class _Store:
  """The two calls the watchdog makes, with the service's NOT_FOUND and failure behaviour."""

  def __init__(self):
    self.values, self.down, self.set_at = {}, False, {}
    self.lock = threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    with self.lock:
      self.values[key] = value
      self.set_at[key] = time.monotonic()

  def key_value_try_get(self, key):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    with self.lock:
      if key not in self.values:
        raise RuntimeError(f"NOT_FOUND: {key} not found")
      return self.values[key]


def _pair(store, lost, timeout_s=0.5):
  return [
    distributed.PeerWatchdog(
      store,
      i,
      2,
      peer_timeout_s=timeout_s,
      interval_s=0.05,
      on_lost=lambda peer, why, i=i: lost.append((i, peer, why, time.monotonic())),
    ).start()
    for i in range(2)
  ]


def _wait(cond, seconds=5.0):
  deadline = time.monotonic() + seconds
  while not cond() and time.monotonic() < deadline:
    time.sleep(0.02)


def test_a_silent_peer_is_reported_after_the_timeout_and_not_before():
  store, lost = _Store(), []
  a, b = _pair(store, lost)
  time.sleep(0.8)  # both beating: nothing is lost
  assert lost == []
  stopped = time.monotonic()
  b.stop(done=False)  # b dies: no more beats, no "done"
  _wait(lambda: lost)
  a.stop()
  assert [(who, peer) for who, peer, _, _ in lost] == [(0, 1)]
  assert "no heartbeat" in lost[0][2]
  # Never before the timeout has passed since the silent peer's last beat; soon after it.
  last_beat = store.set_at["earl_jax/alive/1"]
  assert last_beat <= stopped and lost[0][3] - last_beat >= 0.5
  assert lost[0][3] - stopped < 2.0


def test_a_peer_that_ended_on_purpose_is_not_lost():
  store, lost = _Store(), []
  a, b = _pair(store, lost)
  time.sleep(0.2)
  b.stop(done=True)
  time.sleep(1.0)
  a.stop()
  assert lost == []


def test_an_unreachable_service_is_reported():
  store, lost = _Store(), []
  a, b = _pair(store, lost)
  time.sleep(0.2)
  store.down = True
  _wait(lambda: len(lost) == 2)
  a.stop(done=False)
  b.stop(done=False)
  assert sorted(who for who, *_ in lost) == [0, 1]
  assert all(peer == 0 and "does not answer" in why for _, peer, why, _ in lost)
