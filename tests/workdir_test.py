"""The workdir: writable check and the one-run-per-workdir lock, with the faults injected."""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from earl_jax import workdir as workdir_lib

_REPO = pathlib.Path(__file__).resolve().parent.parent


def test_a_second_lock_fails_at_once_naming_the_holder(tmp_path):
  with workdir_lib.WorkdirLock(tmp_path):
    start = time.perf_counter()
    with pytest.raises(workdir_lib.WorkdirError) as e:
      workdir_lib.WorkdirLock(tmp_path).acquire()
    assert time.perf_counter() - start < 1.0  # never waits for the holder
    message = str(e.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert str(tmp_path) in message and "close() the earlier Trainer" in message
    workdir_lib.WorkdirLock(tmp_path, process_index=1).acquire().release()  # another process's
  with workdir_lib.WorkdirLock(tmp_path):  # released: free again
    pass


_HOLDER = """
import sys, time
from earl_jax import workdir
held = workdir.WorkdirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
  env = dict(os.environ, PYTHONPATH=str(_REPO))
  proc = subprocess.Popen(
    [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
  )
  try:
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(workdir_lib.WorkdirError, match=f"pid {proc.pid} "):
      workdir_lib.WorkdirLock(tmp_path).acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    proc.kill()
  lock = workdir_lib.WorkdirLock(tmp_path).acquire()
  assert any(f"stale lock of pid {proc.pid}" in r.getMessage() for r in caplog.records)
  lock.release()


def test_unwritable_workdirs_are_named_with_the_reason(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(workdir_lib.WorkdirError, match=r"file/run is not writable \(Not a dir"):
    workdir_lib.check_writable(a_file / "run")
  # A read-only directory; as root, permissions do not stop writes, so the check runs as nobody
  # (in a directory nobody can reach: pytest's tmp_path parents are private to their owner).
  base = pathlib.Path(tempfile.mkdtemp())
  base.chmod(0o755)
  read_only = base / "ro"
  read_only.mkdir(mode=0o555)
  read_only.chmod(0o555)
  # The check drops root after the imports (the interpreter itself may be under a private home).
  drop = "import os; os.setuid(65534);" if os.geteuid() == 0 else ""
  code = f"import sys; from earl_jax import workdir; {drop} workdir.check_writable(sys.argv[1])"
  out = subprocess.run(
    [sys.executable, "-c", code, str(read_only / "run")],
    env=dict(os.environ, PYTHONPATH=str(_REPO)),
    capture_output=True,
    text=True,
  )
  shutil.rmtree(base)
  assert out.returncode != 0
  assert f"{read_only}/run is not writable (Permission denied)" in out.stderr
  assert workdir_lib.check_writable(tmp_path / "new" / "run").is_dir()  # created when missing
  with pytest.raises(workdir_lib.WorkdirError, match="is a URL"):
    workdir_lib.check_writable("gs://bucket/run")  # pathlib would make a local 'gs:' folder
