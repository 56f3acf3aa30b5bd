"""Plain mappings -> frozen config dataclasses, checked key by key, and back (``to_dict``).

The converter behind ``config_lib.from_config_dict`` and the environment registry: an unknown key,
a wrong type, a non-finite float or a value a dataclass rejects raises ``ConfigError`` with the
key's dotted path. A leaf module (it imports only ``earl_jax.types``), so any layer may use it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from earl_jax.types import ConfigError

T = TypeVar("T")


def build(cls: type[T], values: Mapping[str, Any], path: str = "") -> T:
  """Builds dataclass ``cls`` from a mapping, checking keys, types and values recursively."""
  if not isinstance(values, Mapping):
    raise ConfigError(path or "<root>", values, f"a dict of {cls.__name__} fields")
  fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(
      _join(path, unknown[0]), values[unknown[0]], f"one of the known keys {sorted(fields)}"
    )
  hints = typing.get_type_hints(cls)
  kwargs = {
    name: _convert(hints[name], values[name], _join(path, name))
    for name in values
    if name in fields
  }
  try:
    return cls(**kwargs)
  except ConfigError as e:
    raise ConfigError(_join(path, e.key), e.value, e.allowed) from None


def _join(path: str, key: str) -> str:
  return f"{path}.{key}" if path else key


def _convert(hint: Any, value: Any, path: str) -> Any:
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(hint)
    if value is None and type(None) in args:
      return None
    (inner,) = [a for a in args if a is not type(None)]
    return _convert(inner, value, path)
  if dataclasses.is_dataclass(hint):
    return build(hint, value, path)
  if isinstance(hint, type) and issubclass(hint, enum.Enum):
    if isinstance(value, hint):
      return value
    allowed = [m.value for m in hint]
    if value not in allowed:
      raise ConfigError(path, value, f"one of {allowed}")
    return hint(value)
  if origin is tuple:
    if not isinstance(value, (tuple, list)):
      raise ConfigError(path, value, f"a tuple ({hint})")
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if len(args) != len(value):
      raise ConfigError(path, value, f"a tuple of {len(args)} items ({hint})")
    return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
  if hint is bool:
    if not isinstance(value, bool):
      raise ConfigError(path, value, "True or False")
    return value
  if hint is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(path, value, "an int")
    return value
  if hint is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(path, value, "a float")
    if not math.isfinite(value):
      raise ConfigError(path, value, "a finite float")
    return float(value)
  if hint is str:
    if not isinstance(value, str):
      raise ConfigError(path, value, "a string")
    return value
  raise TypeError(f"cannot convert {path} of type {hint}")  # a bug in a dataclass


def to_dict(config: Any) -> Any:
  """Dataclass config -> plain JSON-able dict (enums as their values); inverse of ``build``."""
  if dataclasses.is_dataclass(config):
    return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
  if isinstance(config, enum.Enum):
    return config.value
  if isinstance(config, tuple):
    return tuple(to_dict(v) for v in config)
  return config
