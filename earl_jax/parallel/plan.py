"""Parallel plans: which devices, mesh shape and logical->mesh rules each stage runs with.

Data flow: the selector (later) builds a ``ParallelPlan``; ``parallel.mesh`` turns each
``StagePlan`` into a mesh and shardings; the dispatcher moves arrays between the shardings of two
plans. Plans are plain frozen data: hashable (executables are cached on them), printable with
``describe()`` and JSON round-trippable (saved in checkpoint metadata). Nothing here touches a
device, so plans can be built and validated for a cluster this process cannot see.

Validation fails closed: a dimension that does not divide the product of its mesh axes raises
``ShardingError`` naming the dimension, its size and the axes; nothing is silently replicated.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from earl_jax.model.config import ModelConfig
from earl_jax.types import (
  BATCH,
  DATA,
  EMBED,
  FSDP,
  HEADS,
  KV_HEADS,
  LAYERS,
  LOGICAL_AXES,
  MESH_AXES,
  MLP,
  TENSOR,
  VOCAB,
  Stage,
)

Rule = tuple[str, tuple[str, ...]]  # (logical axis name, mesh axes it is sharded over)
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots")


class ShardingError(ValueError):
  """A dimension does not divide its mesh axes, or a plan is inconsistent."""


_TENSOR_RULES: tuple[Rule, ...] = (
  (HEADS, (TENSOR,)),
  (KV_HEADS, (TENSOR,)),  # also shards the KV cache [L, B, K, S, Dh] on its kv_heads axis
  (MLP, (TENSOR,)),
  (VOCAB, (TENSOR,)),
)
_PRESETS: dict[Stage, tuple[Rule, ...]] = {
  # FSDP shards weights (and so optimizer state) on embed; tensor parallelism on the rest.
  Stage.UPDATE: ((BATCH, (DATA, FSDP)), (EMBED, (FSDP,)), *_TENSOR_RULES),
  # Sampling re-reads every weight per token: no FSDP gathers, weights only tensor-sharded.
  # A plan's fsdp axis then acts as extra data parallelism for the batch.
  Stage.ROLLOUT: ((BATCH, (DATA, FSDP)), *_TENSOR_RULES),
  Stage.REFERENCE: ((BATCH, (DATA, FSDP)), *_TENSOR_RULES),
}


def rules_for(stage: Stage) -> tuple[Rule, ...]:
  """The logical->mesh rule preset of a stage kind (see module docstring of the presets)."""
  return _PRESETS[stage]


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """Devices and layout of one stage.

  Attributes:
    stage: which compiled program this plan is for.
    device_ids: global JAX device ids; their order fills the mesh in row-major order.
    mesh_shape: sizes of the mesh axes (data, fsdp, tensor); product == len(device_ids).
    rules: (logical name, mesh axes) pairs; logical names without a rule are replicated.
    micro_batch_size: sequences per gradient-accumulation step; 0 means the whole batch at once.
    remat: activation rematerialisation policy, one of REMAT_POLICIES.
  """

  stage: Stage
  device_ids: tuple[int, ...]
  mesh_shape: tuple[int, int, int]
  rules: tuple[Rule, ...]
  micro_batch_size: int = 0
  remat: str = "none"

  def __post_init__(self) -> None:
    # Normalise lists (JSON, user input) to tuples so the plan stays hashable.
    object.__setattr__(self, "device_ids", tuple(int(d) for d in self.device_ids))
    object.__setattr__(self, "mesh_shape", tuple(int(s) for s in self.mesh_shape))
    rules = tuple((str(name), tuple(str(a) for a in axes)) for name, axes in self.rules)
    object.__setattr__(self, "rules", rules)
    self._validate()

  def _validate(self) -> None:
    if not isinstance(self.stage, Stage):
      raise ShardingError(f"stage={self.stage!r}; allowed: {[s.value for s in Stage]}")
    if len(self.mesh_shape) != len(MESH_AXES) or min(self.mesh_shape) < 1:
      raise ShardingError(
        f"{self.stage.value}: mesh_shape={self.mesh_shape}; allowed: 3 positive sizes for "
        f"axes {MESH_AXES}"
      )
    if len(set(self.device_ids)) != len(self.device_ids) or min(self.device_ids, default=-1) < 0:
      raise ShardingError(
        f"{self.stage.value}: device_ids={self.device_ids} must be distinct non-negative ids"
      )
    if math.prod(self.mesh_shape) != len(self.device_ids):
      raise ShardingError(
        f"{self.stage.value}: mesh {self.axis_sizes} has {math.prod(self.mesh_shape)} devices "
        f"but device_ids lists {len(self.device_ids)}"
      )
    names = [name for name, _ in self.rules]
    for name, axes in self.rules:
      if name not in LOGICAL_AXES:
        raise ShardingError(f"rule for unknown logical axis {name!r}; allowed: {LOGICAL_AXES}")
      if name == LAYERS and axes:
        raise ShardingError(
          f"rule {name!r} -> {axes}: the stacked layer axis is scanned over and never sharded"
        )
      if any(a not in MESH_AXES for a in axes) or len(set(axes)) != len(axes):
        raise ShardingError(f"rule {name!r} -> {axes}: use distinct mesh axes from {MESH_AXES}")
    if len(set(names)) != len(names):
      raise ShardingError(f"{self.stage.value}: duplicate logical names in rules {names}")
    if self.micro_batch_size < 0:
      raise ShardingError(f"micro_batch_size={self.micro_batch_size}; allowed: >= 0")
    if self.remat not in REMAT_POLICIES:
      raise ShardingError(f"remat={self.remat!r}; allowed: {REMAT_POLICIES}")

  @property
  def axis_sizes(self) -> dict[str, int]:
    return dict(zip(MESH_AXES, self.mesh_shape))

  def mesh_axes_for(self, logical_name: str) -> tuple[str, ...]:
    """Mesh axes a logical axis is sharded over (size-1 axes dropped: they shard nothing)."""
    sizes = self.axis_sizes
    for name, axes in self.rules:
      if name == logical_name:
        return tuple(a for a in axes if sizes[a] > 1)
    return ()

  def shards_for(self, logical_name: str) -> int:
    sizes = self.axis_sizes
    return math.prod(sizes[a] for a in self.mesh_axes_for(logical_name))

  def describe(self) -> str:
    ids = self.device_ids
    contiguous = ids == tuple(range(ids[0], ids[0] + len(ids)))
    devices = f"{ids[0]}-{ids[-1]}" if contiguous and len(ids) > 1 else ",".join(map(str, ids))
    mesh = " ".join(f"{a}={s}" for a, s in self.axis_sizes.items())
    return (
      f"{self.stage.value}[devices {devices}; {mesh}; mb={self.micro_batch_size}; "
      f"remat={self.remat}]"
    )

  def to_json_dict(self) -> dict[str, Any]:
    return {
      "stage": self.stage.value,
      "device_ids": list(self.device_ids),
      "mesh_shape": list(self.mesh_shape),
      "rules": [[name, list(axes)] for name, axes in self.rules],
      "micro_batch_size": self.micro_batch_size,
      "remat": self.remat,
    }

  @classmethod
  def from_json_dict(cls, d: Mapping[str, Any]) -> StagePlan:
    return cls(
      stage=Stage(d["stage"]),
      device_ids=tuple(d["device_ids"]),
      mesh_shape=tuple(d["mesh_shape"]),
      rules=tuple((name, tuple(axes)) for name, axes in d["rules"]),
      micro_batch_size=d["micro_batch_size"],
      remat=d["remat"],
    )


def make_stage_plan(
  stage: Stage,
  device_ids: Sequence[int],
  data: int = 1,
  fsdp: int = 1,
  tensor: int = 1,
  *,
  micro_batch_size: int = 0,
  remat: str = "none",
  rules: tuple[Rule, ...] | None = None,
) -> StagePlan:
  """A plan for ``stage`` on ``device_ids``; one of data/fsdp/tensor may be -1 (filled in)."""
  sizes = [data, fsdp, tensor]
  n = len(device_ids)
  fill = [i for i, s in enumerate(sizes) if s == -1]
  if len(fill) > 1 or any(s < 1 and s != -1 for s in sizes):
    raise ShardingError(f"(data, fsdp, tensor)={tuple(sizes)}; allowed: positive, at most one -1")
  if fill:
    known = math.prod(s for s in sizes if s != -1)
    if n % known:
      raise ShardingError(
        f"cannot fill {MESH_AXES[fill[0]]}=-1: {n} devices do not divide by the other axes "
        f"product {known}"
      )
    sizes[fill[0]] = n // known
  return StagePlan(
    stage=stage,
    device_ids=tuple(device_ids),
    mesh_shape=tuple(sizes),
    rules=rules_for(stage) if rules is None else rules,
    micro_batch_size=micro_batch_size,
    remat=remat,
  )


def check_divisible(plan: StagePlan, logical_name: str, size: int, what: str = "") -> None:
  """Raises ShardingError unless ``size`` divides the mesh axes ``logical_name`` maps to."""
  shards = plan.shards_for(logical_name)
  if size % shards:
    axes = plan.mesh_axes_for(logical_name)
    sizes = "*".join(f"{a}={plan.axis_sizes[a]}" for a in axes)
    raise ShardingError(
      f"{plan.stage.value}: {what or logical_name} has size {size}, which does not divide "
      f"mesh axes {axes} ({sizes} = {shards}); change the plan or pad the dimension"
    )


def logical_to_spec(
  logical_spec: PartitionSpec | Sequence[Any], shape: Sequence[int], plan: StagePlan
) -> PartitionSpec:
  """Maps a PartitionSpec of logical names to one of mesh axes, checking every dimension."""
  entries = tuple(logical_spec)
  if len(entries) > len(shape):
    raise ShardingError(f"logical spec {entries} has more entries than shape {tuple(shape)}")
  out: list[Any] = []
  used: dict[str, str] = {}
  for dim, (entry, size) in enumerate(zip(entries, shape)):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    axes: list[str] = []
    for name in names:
      for axis in plan.mesh_axes_for(name):
        if axis in used:
          raise ShardingError(
            f"{plan.stage.value}: mesh axis {axis!r} would shard both {used[axis]!r} and "
            f"{name!r} of logical spec {entries}; change the rules"
          )
        used[axis] = name
        axes.append(axis)
    shards = math.prod(plan.axis_sizes[a] for a in axes)
    if size % shards:
      sizes = "*".join(f"{a}={plan.axis_sizes[a]}" for a in axes)
      raise ShardingError(
        f"{plan.stage.value}: dimension {dim} ({'/'.join(names)}) of shape {tuple(shape)} has "
        f"size {size}, which does not divide mesh axes {tuple(axes)} ({sizes} = {shards})"
      )
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  while out and out[-1] is None:  # canonical form: P('x', None) and P('x') mean the same
    out.pop()
  return PartitionSpec(*out)


def validate_for_model(plan: StagePlan, cfg: ModelConfig, batch_size: int | None = None) -> None:
  """Checks every model dimension (and the global batch) against the plan's axes."""
  check_divisible(plan, HEADS, cfg.num_heads, "num_heads")
  check_divisible(plan, KV_HEADS, cfg.num_kv_heads, "num_kv_heads")
  check_divisible(plan, MLP, cfg.mlp_dim, "mlp_dim")
  check_divisible(plan, EMBED, cfg.embed_dim, "embed_dim")
  check_divisible(
    plan, VOCAB, cfg.padded_vocab_size, f"padded_vocab_size (vocab_multiple={cfg.vocab_multiple})"
  )
  if batch_size is not None:
    check_divisible(plan, BATCH, batch_size, "global batch size")


@dataclasses.dataclass(frozen=True)
class ParallelPlan(Mapping):
  """Stage -> StagePlan, frozen and hashable; iterate it like a dict."""

  stages: tuple[StagePlan, ...]

  def __post_init__(self) -> None:
    order = list(Stage)
    stages = tuple(sorted(self.stages, key=lambda p: order.index(p.stage)))
    kinds = [p.stage for p in stages]
    if len(set(kinds)) != len(kinds):
      raise ShardingError(f"ParallelPlan has several plans for one stage: {kinds}")
    object.__setattr__(self, "stages", stages)

  @classmethod
  def of(cls, plans: Mapping[Stage, StagePlan] | Sequence[StagePlan]) -> ParallelPlan:
    items = list(plans.values()) if isinstance(plans, Mapping) else list(plans)
    if isinstance(plans, Mapping):
      for stage, p in plans.items():
        if p.stage != stage:
          raise ShardingError(f"key {stage} holds a plan for {p.stage}")
    return cls(tuple(items))

  def __getitem__(self, stage: Stage) -> StagePlan:
    for p in self.stages:
      if p.stage == stage:
        return p
    raise KeyError(f"no plan for {stage}; have {[p.stage.value for p in self.stages]}")

  def __iter__(self) -> Iterator[Stage]:
    return iter(p.stage for p in self.stages)

  def __len__(self) -> int:
    return len(self.stages)

  def __hash__(self) -> int:
    return hash(self.stages)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ParallelPlan) and self.stages == other.stages

  def describe(self) -> str:
    return " | ".join(p.describe() for p in self.stages)

  def to_json(self) -> str:
    return json.dumps([p.to_json_dict() for p in self.stages], sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> ParallelPlan:
    return cls(tuple(StagePlan.from_json_dict(d) for d in json.loads(text)))
