"""Tests for earl_jax.parallel.plan: presets, fill-in, validation errors, JSON round trip."""

import pytest
from jax.sharding import PartitionSpec as P

from earl_jax.model.config import ModelConfig
from earl_jax.parallel import plan as plan_lib
from earl_jax.types import BATCH, EMBED, HEADS, KV_HEADS, NORM, VOCAB, Stage


def test_presets_map_logical_names_per_stage():
  update = plan_lib.make_stage_plan(Stage.UPDATE, range(8), 1, 4, 2)
  rollout = plan_lib.make_stage_plan(Stage.ROLLOUT, range(8), 2, 1, 4)
  shape = (128, 64)
  assert plan_lib.logical_to_spec((VOCAB, EMBED), shape, update) == P("tensor", "fsdp")
  assert plan_lib.logical_to_spec((VOCAB, EMBED), shape, rollout) == P("tensor")
  assert plan_lib.logical_to_spec((BATCH, None), (8, 3), update) == P("fsdp")
  assert plan_lib.logical_to_spec((BATCH,), (8,), rollout) == P("data")
  assert plan_lib.logical_to_spec((NORM,), (64,), update) == P()
  both = plan_lib.make_stage_plan(Stage.ROLLOUT, range(8), 2, 2, 2)
  assert plan_lib.logical_to_spec((BATCH,), (8,), both) == P(("data", "fsdp"))


def test_fill_in_and_errors():
  p = plan_lib.make_stage_plan(Stage.UPDATE, range(8), 1, -1, 2)
  assert p.mesh_shape == (1, 4, 2)
  with pytest.raises(plan_lib.ShardingError, match="cannot fill"):
    plan_lib.make_stage_plan(Stage.UPDATE, range(6), 1, -1, 4)
  with pytest.raises(plan_lib.ShardingError, match="device_ids lists 4"):
    plan_lib.StagePlan(Stage.UPDATE, (0, 1, 2, 3), (1, 2, 4), plan_lib.rules_for(Stage.UPDATE))
  with pytest.raises(plan_lib.ShardingError, match="remat"):
    plan_lib.make_stage_plan(Stage.UPDATE, range(2), 2, 1, 1, remat="some")


def test_validation_names_dimension_size_and_axes():
  rollout = plan_lib.make_stage_plan(Stage.ROLLOUT, range(8), 2, 1, 4)
  cfg = ModelConfig(num_heads=8, num_kv_heads=2, head_dim=8, vocab_size=100, vocab_multiple=64)
  with pytest.raises(plan_lib.ShardingError, match=r"num_kv_heads has size 2.*tensor=4"):
    plan_lib.validate_for_model(rollout, cfg)
  ok = ModelConfig(num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=100, vocab_multiple=64)
  plan_lib.validate_for_model(rollout, ok, batch_size=6)  # batch 6 % data 2 == 0
  with pytest.raises(plan_lib.ShardingError, match=r"global batch size has size 3.*data=2"):
    plan_lib.validate_for_model(rollout, ok, batch_size=3)
  with pytest.raises(plan_lib.ShardingError, match=r"dimension 1 \(heads\).*size 6.*tensor"):
    plan_lib.logical_to_spec((EMBED, HEADS), (64, 6), rollout)
  with pytest.raises(plan_lib.ShardingError, match="would shard both"):
    plan_lib.logical_to_spec((HEADS, KV_HEADS), (8, 8), rollout)


def test_parallel_plan_is_hashable_printable_and_round_trips():
  plans = plan_lib.ParallelPlan.of(
    {
      Stage.UPDATE: plan_lib.make_stage_plan(Stage.UPDATE, range(4), 1, 2, 2, micro_batch_size=4),
      Stage.ROLLOUT: plan_lib.make_stage_plan(Stage.ROLLOUT, [7, 6, 5, 4], 1, 1, 4, remat="full"),
    }
  )
  again = plan_lib.ParallelPlan.from_json(plans.to_json())
  assert again == plans and hash(again) == hash(plans)
  assert {plans: 1}[again] == 1
  assert plans[Stage.ROLLOUT].device_ids == (7, 6, 5, 4)
  text = plans.describe()
  assert "rollout[devices 7,6,5,4; data=1 fsdp=1 tensor=4" in text and "update[devices 0-3" in text
  assert list(plans) == [Stage.ROLLOUT, Stage.UPDATE]
  with pytest.raises(KeyError, match="no plan for"):
    plans[Stage.REFERENCE]
