"""Block geometry of shardings: which device holds which block, and what a move costs.

Used by the dispatcher to pick a route per leaf and to account for a move from shardings alone
(no data is read): bytes that change device, bytes through each process, number of transfers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

Block = tuple[tuple[int, int], ...]  # per dimension [start, stop)


def block_map(sharding: Sharding, shape: Sequence[int]) -> dict[jax.Device, Block]:
  """Device -> the block of a ``shape`` array it holds under ``sharding``."""
  shape = tuple(shape)
  out = {}
  for device, index in sharding.devices_indices_map(shape).items():
    out[device] = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
  return out


def equivalent(a: Sharding, b: Sharding, shape: Sequence[int]) -> bool:
  """Same device list order and every device holding the same block."""
  return list(a._device_assignment) == list(b._device_assignment) and block_map(
    a, shape
  ) == block_map(b, shape)


def blocks_line_up(src: Sharding, dst: Sharding, shape: Sequence[int]) -> bool:
  """True when every destination block is exactly a block some source device holds."""
  return set(block_map(dst, shape).values()) <= set(block_map(src, shape).values())


def as_named(sharding: Sharding) -> NamedSharding:
  """NamedSharding equivalent of a single-device or named sharding."""
  if isinstance(sharding, NamedSharding):
    return sharding
  if isinstance(sharding, SingleDeviceSharding):
    (device,) = sharding.device_set
    return NamedSharding(Mesh(np.array([device], dtype=object), ("_single",)), PartitionSpec())
  raise TypeError(
    f"dispatch handles NamedSharding and SingleDeviceSharding leaves, got {type(sharding)}; "
    "put the array on a NamedSharding first"
  )


def with_devices(sharding: NamedSharding, devices: Sequence[jax.Device]) -> NamedSharding:
  """``sharding``'s layout on ``devices`` (a multiple of its device count; extras replicate)."""
  mesh = sharding.mesh
  n_src, n_dst = mesh.devices.size, len(devices)
  if n_dst % n_src:
    raise ValueError(f"{n_dst} devices are not a multiple of the sharding's {n_src}")
  shape = (*mesh.devices.shape, n_dst // n_src)
  grid = np.array(list(devices), dtype=object).reshape(shape)
  return NamedSharding(Mesh(grid, (*mesh.axis_names, "_copy")), sharding.spec)


def _overlap(a: Block, b: Block) -> int:
  return math.prod(max(0, min(x1, y1) - max(x0, y0)) for (x0, x1), (y0, y1) in zip(a, b))


@dataclasses.dataclass
class MoveCost:
  """What moving one array from one sharding to another costs, computed from shardings."""

  bytes_moved: int = 0
  transfers: int = 0
  bytes_by_process: dict[int, int] = dataclasses.field(default_factory=dict)

  def add(self, other: MoveCost) -> None:
    self.bytes_moved += other.bytes_moved
    self.transfers += other.transfers
    for p, b in other.bytes_by_process.items():
      self.bytes_by_process[p] = self.bytes_by_process.get(p, 0) + b


def move_cost(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int) -> MoveCost:
  """Bytes each destination device lacks, fetched from the nearest holder of each piece.

  A piece already on the receiving device is free; otherwise it comes from a holder in the same
  process if there is one. Each moved byte counts for the receiving and (if another) the sending
  process.
  """
  src_map, cost = block_map(src, shape), MoveCost()
  holders: dict[Block, list[jax.Device]] = {}
  for device, block in src_map.items():
    holders.setdefault(block, []).append(device)
  for device, block in block_map(dst, shape).items():
    for src_block, devices in holders.items():
      volume = _overlap(block, src_block)
      if volume == 0 or device in devices:
        continue
      same = [d for d in devices if d.process_index == device.process_index]
      sender = (same or devices)[0]
      nbytes = volume * itemsize
      cost.bytes_moved += nbytes
      cost.transfers += 1
      for p in {device.process_index, sender.process_index}:
        cost.bytes_by_process[p] = cost.bytes_by_process.get(p, 0) + nbytes
  return cost
