"""Test setup shared by every test: 8 simulated CPU devices, set before JAX initialises."""

import os

# Must run before jax creates its backends. Appending keeps any flags the caller set.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

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
