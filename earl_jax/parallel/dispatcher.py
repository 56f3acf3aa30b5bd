"""The layout-aware data dispatcher: moves pytrees between stage layouts without the host.

Data flow: rollout batch -> reference layout, scored batch -> update layout, and the weight sync
update -> rollout (``sync_weights``) all go through ``dispatch``. The route is planned per leaf
from shardings alone (DESIGN.md "Dispatcher facts"): ``jax.device_put`` silently gathers on the
host unless the target blocks are source blocks or only the device order changes, and jit needs
one device list, so

  noop      source sharding already equivalent to the target
  put       device_put: every target block is a source block (or only device order changes)
  jit       jitted identity with out_shardings on the same device list (on-device re-layout)
  put_jit   across device sets, |dst| a multiple of |src|: move blocks in the source layout onto
            the target devices (host-free), then re-layout there
  jit_put   across device sets, |src| a multiple of |dst|: re-layout on the source devices to
            the target blocks, then move them
  assemble  multi-process, dst devices inside src devices: on-device reorder so the dst devices
            hold the dst blocks, then take those buffers (no copy)
  union     multi-process, other device sets: one jit over src + dst devices moves the blocks
            (cross-process collectives), then the dst buffers are taken

Routes and their byte costs are pure functions of (source sharding, target sharding, shape) and
cached per such key, so a repeated move (the weight sync of every step) plans nothing again.
Cost accounting is opt-in (``account=True``); nothing blocks unless ``measure=True``.

``mode="centralized"`` is the single-controller baseline (everything through the host, one replica
per block as ``jax.device_get`` fetches it), for benchmarks and tests only.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from earl_jax.parallel import blocks
from earl_jax.parallel.mesh import state_shardings
from earl_jax.parallel.plan import StagePlan

__all__ = ["DispatchError", "DispatchStats", "dispatch", "sync_weights"]


class DispatchError(ValueError):
  """A move the dispatcher cannot do without the host (or an inconsistent request)."""


@dataclasses.dataclass(frozen=True)
class DispatchStats:
  """What one dispatch did. Device byte counts are global (all processes), from shardings;
  host bytes are counted on this process as they are copied."""

  mode: str
  bytes_total: int  # logical size of the tree
  bytes_through_host: int  # counted copies (centralized); 0 in direct mode, where the host is
  # shut out (a host transfer raises)
  routes: tuple[tuple[str, str], ...]  # (leaf path, route)
  seconds: float | None = None  # wall time to ready arrays; only with measure=True
  bytes_moved: int | None = None  # bytes that changed device (over all hops); account=True
  bytes_busiest_process: int | None = None  # max over processes of bytes sent or received
  num_transfers: int | None = None  # device-to-device pieces, or host copies (centralized)

  def route_counts(self) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, route in self.routes:
      counts[route] = counts.get(route, 0) + 1
    return counts


@functools.lru_cache(maxsize=512)
def _identity(dst: Sharding) -> Any:
  return jax.jit(lambda a: a, out_shardings=dst)


@functools.lru_cache(maxsize=512)
def _union_fn(out: Sharding, row: int, rows: int) -> Any:
  def place(y: jax.Array) -> jax.Array:
    return jnp.zeros((rows, *y.shape[1:]), y.dtype).at[row].set(y[0])

  return jax.jit(place, out_shardings=out)


@functools.lru_cache(maxsize=512)
def _zeros(shape: tuple[int, ...], dtype: Any, device: jax.Device) -> Any:
  # Generated on the device by a jit: jnp.zeros(device=...) would upload its fill value.
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=SingleDeviceSharding(device))


def _devices(sharding: Sharding) -> list[jax.Device]:
  return list(sharding._device_assignment)


def _grid(devices: Sequence[jax.Device], shape: Sequence[int]) -> np.ndarray:
  return np.array(list(devices), dtype=object).reshape(tuple(shape))


def _take_buffers(y: jax.Array, devices: set[jax.Device], drop_lead: bool) -> list[jax.Array]:
  out = []
  for shard in y.addressable_shards:
    if shard.device in devices:
      out.append(shard.data.reshape(shard.data.shape[1:]) if drop_lead else shard.data)
  return out


@functools.lru_cache(maxsize=4096)
def _route(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int) -> str:
  """The route for one leaf; a pure function of the layouts, cached per (src, dst, shape)."""
  if src == dst or blocks.equivalent(src, dst, shape):
    return "noop"
  same_set = src.device_set == dst.device_set
  if same_set and _devices(src) == _devices(dst):
    return "put" if blocks.blocks_line_up(src, dst, shape) else "jit"
  if same_set:
    return "put"  # jax reorders shards on device, then re-layouts with a jit
  n_src, n_dst = len(src.device_set), len(dst.device_set)
  if src.is_fully_addressable and dst.is_fully_addressable:
    if blocks.blocks_line_up(src, dst, shape):
      return "put"
    if n_dst == n_src:  # both work: take the one that moves fewer bytes
      costs = {
        r: _two_hop_cost(src, mid(src, blocks.as_named(dst)), dst, shape, itemsize)
        for r, mid in (("jit_put", _mid_jit_put), ("put_jit", _mid_put_jit))
      }
      return min(costs, key=costs.get)
    if n_dst % n_src == 0:
      return "put_jit"
    if n_src % n_dst == 0:
      return "jit_put"
  elif dst.device_set < src.device_set and n_src % n_dst == 0:
    return "assemble"
  else:
    return "union"
  raise DispatchError(
    f"cannot move a {shape} array from {n_src} to {n_dst} other devices on device: "
    "use device sets whose sizes are multiples of each other"
  )


@functools.lru_cache(maxsize=4096)
def _leaf_cost(
  src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, route: str
) -> blocks.MoveCost:
  """Bytes and transfers of ``route`` (every hop), from the shardings alone; cached, so the
  cost of a 72B weight sync is computed once per layout pair. Callers never mutate the result."""
  if route == "noop":
    return blocks.MoveCost()
  if route in ("put", "jit"):
    return blocks.move_cost(src, dst, shape, itemsize)
  if route == "union":
    _, _, chunk = _union_layout(src, blocks.as_named(dst))
    return blocks.move_cost(src, chunk, shape, itemsize)
  mid = {"put_jit": _mid_put_jit, "jit_put": _mid_jit_put, "assemble": _assemble_sharding}[route](
    src, blocks.as_named(dst)
  )
  cost = blocks.MoveCost()
  cost.add(blocks.move_cost(src, mid, shape, itemsize))
  cost.add(blocks.move_cost(mid, dst, shape, itemsize))
  return cost


def _mid_put_jit(src: Sharding, dst: NamedSharding) -> NamedSharding:
  """The source layout on the destination devices (replicated if there are more of them)."""
  return blocks.with_devices(blocks.as_named(src), _devices(dst))


def _mid_jit_put(src: Sharding, dst: NamedSharding) -> NamedSharding:
  """The destination blocks on the source devices (replicated if there are more of them)."""
  copies = len(src.device_set) // len(dst.device_set)
  grid = _grid(_devices(src), (*dst.mesh.devices.shape, copies))
  return NamedSharding(Mesh(grid, (*dst.mesh.axis_names, "_copy")), dst.spec)


def _two_hop_cost(
  src: Sharding, mid: Sharding, dst: Sharding, shape: tuple[int, ...], item: int
) -> int:
  return (
    blocks.move_cost(src, mid, shape, item).bytes_moved
    + blocks.move_cost(mid, dst, shape, item).bytes_moved
  )


def _assemble_sharding(src: Sharding, dst: NamedSharding) -> NamedSharding:
  """Over src's devices, dst devices first (in dst order): the dst layout, replicated."""
  dst_devices = _devices(dst)
  rest = [d for d in _devices(src) if d not in dst.device_set]
  copies = len(src.device_set) // len(dst_devices)
  mesh = Mesh(
    _grid(dst_devices + rest, (copies, *dst.mesh.devices.shape)), ("_copy", *dst.mesh.axis_names)
  )
  return NamedSharding(mesh, dst.spec)  # the unused _copy axis replicates


def _union_layout(
  src: NamedSharding, dst: NamedSharding
) -> tuple[list[jax.Device], int, NamedSharding]:
  """For a "union" move: the union's device order, the row of it that the destination devices
  form, and the destination layout on that row's devices (in union order)."""
  src_devices, dst_devices = _devices(src), _devices(dst)
  union = src_devices + [d for d in dst_devices if d not in src.device_set]
  n_u, n_d = len(union), len(dst_devices)
  row = next(
    (j for j in range(n_u // n_d) if set(union[j * n_d : (j + 1) * n_d]) == dst.device_set), None
  )
  if n_u % len(src_devices) or n_u % n_d or row is None:
    raise DispatchError(
      f"multi-process move from devices {[d.id for d in src_devices]} to "
      f"{[d.id for d in dst_devices]} is not supported on device: the destination must be a "
      "subset of the source, contain it, or be disjoint and of the same size"
    )
  chunk = union[row * n_d : (row + 1) * n_d]
  chunk_sharding = NamedSharding(
    Mesh(_grid(chunk, dst.mesh.devices.shape), dst.mesh.axis_names), dst.spec
  )
  return union, row, chunk_sharding


def _union_move(x: jax.Array, dst: NamedSharding) -> jax.Array:
  src = blocks.as_named(x.sharding)
  union, row, chunk_sharding = _union_layout(src, dst)
  rows_in, rows_out = len(union) // len(src.device_set), len(union) // len(dst.device_set)
  y_sharding = NamedSharding(
    Mesh(_grid(union, (rows_in, *src.mesh.devices.shape)), ("_row", *src.mesh.axis_names)),
    PartitionSpec("_row", *src.spec),
  )
  block = src.shard_shape(x.shape)
  local = [s.data.reshape((1, *block)) for s in x.addressable_shards]
  local += [
    _zeros((1, *block), x.dtype, d)()
    for d in union[len(src.device_set) :]
    if d.process_index == jax.process_index()
  ]
  y = jax.make_array_from_single_device_arrays(
    (rows_in, *x.shape), y_sharding, local, dtype=x.dtype
  )
  out_sharding = NamedSharding(
    Mesh(_grid(union, (rows_out, *dst.mesh.devices.shape)), ("_row", *dst.mesh.axis_names)),
    PartitionSpec("_row", *dst.spec),
  )
  out = _union_fn(out_sharding, row, rows_out)(y)
  z = jax.make_array_from_single_device_arrays(
    x.shape, chunk_sharding, _take_buffers(out, dst.device_set, drop_lead=True), dtype=x.dtype
  )
  if _devices(chunk_sharding) != _devices(dst):
    z = jax.device_put(z, dst)
  return z


def _move(x: jax.Array, dst: Sharding, route: str) -> jax.Array:
  """Executes ``route`` for one leaf (``_leaf_cost`` says what it costs)."""
  if route == "noop":
    return x if x.sharding == dst else jax.device_put(x, dst)
  if route == "put":
    return jax.device_put(x, dst)
  if route == "jit":
    return _identity(dst)(x)
  dst_named = blocks.as_named(dst)
  if route == "put_jit":
    return _identity(dst)(jax.device_put(x, _mid_put_jit(x.sharding, dst_named)))
  if route == "jit_put":
    return jax.device_put(_identity(_mid_jit_put(x.sharding, dst_named))(x), dst)
  if route == "assemble":
    moved = jax.device_put(x, _assemble_sharding(x.sharding, dst_named))
    bufs = _take_buffers(moved, dst.device_set, drop_lead=False)
    return jax.make_array_from_single_device_arrays(x.shape, dst, bufs, dtype=x.dtype)
  if route == "union":
    return _union_move(x, dst_named)
  raise AssertionError(route)


def _not_participating(x: jax.Array, dst: Sharding) -> bool:
  me = jax.process_index()
  return all(d.process_index != me for d in x.sharding.device_set | dst.device_set)


def _move_direct(x: jax.Array, dst: Sharding) -> tuple[jax.Array, str]:
  """One leaf, device to device. The host is shut out while it moves: a route that fell back to
  the host (``jax.device_put`` does that silently for some layout pairs) raises instead, which is
  what makes the direct mode's ``bytes_through_host`` a measurement rather than a claim."""
  route = _route(x.sharding, dst, x.shape, x.dtype.itemsize)
  if _not_participating(x, dst):
    # This process holds no block of either side; it only needs the global array object.
    return jax.make_array_from_single_device_arrays(x.shape, dst, [], dtype=x.dtype), route
  with (
    jax.transfer_guard_device_to_device("allow"),
    jax.transfer_guard_device_to_host("disallow_explicit"),
    jax.transfer_guard_host_to_device("disallow_explicit"),
  ):
    return _move(x, dst, route), route


class _HostCounter:
  """Bytes the centralized baseline really copies through the host (counted as they are copied)."""

  def __init__(self) -> None:
    self.bytes = 0
    self.transfers = 0

  def fetch(self, x: jax.Array) -> np.ndarray:
    """One replica per block to the host, as ``jax.device_get`` does."""
    host = np.empty(x.shape, x.dtype)
    seen: set[tuple[tuple[int, int, int], ...]] = set()
    for shard in x.addressable_shards:
      key = tuple(s.indices(n) for s, n in zip(shard.index, x.shape))
      if key in seen:
        continue
      seen.add(key)
      # Copied shard by shard: np.asarray(x) caches the host copy on the array, which would make
      # repeated baseline runs free.
      block = np.asarray(shard.data)
      host[shard.index] = block
      self.bytes += block.nbytes
      self.transfers += 1
    return host

  def scatter(self, host: np.ndarray, dst: Sharding) -> jax.Array:
    def block(index):
      piece = host[index]
      self.bytes += piece.nbytes
      self.transfers += 1
      return piece

    return jax.make_array_from_callback(host.shape, dst, block, dtype=host.dtype)


def _move_centralized(x: jax.Array, dst: Sharding, counter: _HostCounter) -> jax.Array:
  """Single-controller baseline: the leaf to the host as numpy, then a host scatter."""
  if jax.process_count() == 1:
    host = counter.fetch(x)
  else:
    # Multi-controller emulation of "gather to the controller": an on-device all-gather to every
    # device (what process_allgather does, which also needs shards on every process), then one
    # device->host copy per process. Every process takes this branch, whether or not it holds the
    # source (deciding by x.is_fully_addressable let one process skip the collective the others
    # entered: a hang or a collective mismatch).
    everywhere = NamedSharding(
      Mesh(np.array(jax.devices(), dtype=object), ("_all",)), PartitionSpec()
    )
    replicated, _ = _move_direct(x, everywhere)
    host = counter.fetch(replicated.addressable_shards[0].data)
  return counter.scatter(host, dst)


def _check_leaves(leaves: list[Any], dsts: list[Any]) -> None:
  if len(leaves) != len(dsts):
    raise DispatchError(f"tree has {len(leaves)} leaves but dst_shardings has {len(dsts)}")
  for i, (x, dst) in enumerate(zip(leaves, dsts)):
    if not isinstance(x, jax.Array) or not isinstance(dst, Sharding):
      raise DispatchError(f"leaf {i}: need a jax.Array and a Sharding, got {type(x)}, {type(dst)}")
    try:
      dst.shard_shape(x.shape)
    except ValueError as e:
      raise DispatchError(f"leaf {i} of shape {x.shape} does not divide {dst}: {e}") from None


def _dispatch_direct(leaves: list[jax.Array], dsts: list[Sharding], account: bool):
  """(moved leaves, routes, host bytes (0), cost or None)."""
  moved = [_move_direct(x, dst) for x, dst in zip(leaves, dsts)]
  cost = None
  if account:
    cost = blocks.MoveCost()
    for x, dst, (_, route) in zip(leaves, dsts, moved):
      cost.add(_leaf_cost(x.sharding, dst, x.shape, x.dtype.itemsize, route))
  return [y for y, _ in moved], [r for _, r in moved], 0, cost


def _dispatch_centralized(leaves: list[jax.Array], dsts: list[Sharding], account: bool):
  """(moved leaves, routes, host bytes counted, cost or None)."""
  counter = _HostCounter()
  out = [_move_centralized(x, dst, counter) for x, dst in zip(leaves, dsts)]
  cost = None
  if account:
    cost = blocks.MoveCost(counter.bytes, counter.transfers, {jax.process_index(): counter.bytes})
  return out, ["host"] * len(out), counter.bytes, cost


def dispatch(
  tree: Any,
  dst_shardings: Any,
  *,
  mode: str = "direct",
  account: bool = False,
  measure: bool = False,
) -> tuple[Any, DispatchStats]:
  """Moves every leaf of ``tree`` to the matching sharding of ``dst_shardings`` (same structure).

  Asynchronous like any JAX call: the moves are enqueued and the result returned at once, unless
  ``measure`` asks to wait for them.

  Args:
    tree: pytree of jax.Array (an nnx.State works).
    dst_shardings: pytree of Sharding with the tree's structure.
    mode: "direct" (host-free routes) or "centralized" (host baseline, benchmarks/tests only).
    account: fill the device-side byte accounting (``bytes_moved``, ``bytes_busiest_process``,
      ``num_transfers``), computed from the shardings and cached per (source, target, shape);
      ``None`` in the stats otherwise.
    measure: block until the moved arrays are ready and report ``seconds`` (``None`` otherwise).

  Returns:
    (moved tree, DispatchStats). ``bytes_through_host`` is counted as bytes are copied in the
    centralized mode; the direct mode runs with host transfers disallowed (a host fallback
    raises instead of copying), so its 0 is enforced, not assumed.
  """
  if mode not in ("direct", "centralized"):
    raise DispatchError(f"mode={mode!r}; allowed: 'direct', 'centralized'")
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = [x for _, x in leaves_with_path]
  dsts = treedef.flatten_up_to(dst_shardings)
  _check_leaves(leaves, dsts)
  start = time.perf_counter()
  move = _dispatch_centralized if mode == "centralized" else _dispatch_direct
  out, routes, host_bytes, cost = move(leaves, dsts, account)
  routes = tuple((jax.tree_util.keystr(p), r) for (p, _), r in zip(leaves_with_path, routes))
  seconds = None
  if measure:
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
  stats = DispatchStats(
    mode=mode,
    bytes_total=sum(x.nbytes for x in leaves),
    bytes_through_host=host_bytes,
    routes=routes,
    seconds=seconds,
    bytes_moved=None if cost is None else cost.bytes_moved,
    bytes_busiest_process=None if cost is None else max(cost.bytes_by_process.values(), default=0),
    num_transfers=None if cost is None else cost.transfers,
  )
  return jax.tree_util.tree_unflatten(treedef, out), stats


def sync_weights(
  params_state: nnx.State, dst_plan: StagePlan, **dispatch_kwargs: Any
) -> tuple[nnx.State, DispatchStats]:
  """Weight sync (update -> rollout): the state moved to ``dst_plan``'s parameter shardings;
  ``dispatch_kwargs`` go to ``dispatch`` (mode, account, measure)."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_state)
  return dispatch(params_state, state_shardings(abstract, dst_plan), **dispatch_kwargs)
