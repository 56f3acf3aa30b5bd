"""Test setup shared by every test: 8 simulated CPU devices, set before JAX initialises."""

import os
import shutil
import tempfile

# Must run before jax creates its backends. Appending keeps any flags the caller set.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole session: every xdist worker and every process a
# test starts (the trainer, notebook and benchmark subprocesses inherit the environment) loads a
# program another test already compiled instead of compiling it again. The programs and what
# they compute are the same; only repeated compiles are skipped (measured: the SIGKILL-resume
# test, three processes of one config, 126 s -> 66 s). Every program is cached, however short
# its compile. A cache the caller chose is kept; the one made here is removed at the end.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="earl_jax_test_compile_cache_")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402 (after the environment above)
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line("markers", "requires_devices(n): needs at least n JAX devices")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  del config
  n = jax.device_count()
  for item in items:
    marker = item.get_closest_marker("requires_devices")
    if marker and n < marker.args[0]:
      item.add_marker(pytest.mark.skip(reason=f"needs {marker.args[0]} devices, have {n}"))


def pytest_unconfigure(config: pytest.Config) -> None:
  del config
  if _OWN_CACHE:
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
