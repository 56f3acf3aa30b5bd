"""Mixed precision at the shipped Qwen configs' settings: f32 master weights and Adam moments, bf16
compute, lr 1e-6. One update on a tiny local bf16 HF checkpoint moves every weight that has a
gradient, by exactly a float64 AdamW step; pure bf16 would leave most weights where they were."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from configs import connect_four_qwen2_5_0_5b
from earl_jax import config_lib
from earl_jax.model import from_pretrained
from earl_jax.rl import batches, objective, update
from earl_jax.types import DType

_VOCAB = 97


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
  """A tiny Qwen2 with HF's own init (weights ~N(0, 0.02), as real LLM weights), saved in bf16."""
  path = tmp_path_factory.mktemp("qwen_tiny")
  config = transformers.Qwen2Config(
    vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
  )  # fmt: skip
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
  with torch.no_grad():  # HF inits biases to 0 and norms to 1: give them a spread too
    for name, p in model.named_parameters():
      if "bias" in name or "norm" in name:
        p.add_(torch.randn_like(p) * 0.02)
  model.save_pretrained(path)
  return str(path)


def _experiment(checkpoint: str) -> config_lib.ExperimentConfig:
  c = connect_four_qwen2_5_0_5b.get_config()
  c.pretrained_path = c.tokenizer.path = checkpoint
  c.optim.warmup_steps = 0  # the first step at the full learning rate
  return config_lib.from_config_dict(c)


def _batch(b: int = 4, t: int = 16) -> batches.AdvantageBatch:
  rng = np.random.default_rng(0)
  valid = np.arange(t)[None, :] < rng.integers(8, t + 1, size=b)[:, None]
  tokens = np.where(valid, rng.integers(1, _VOCAB, size=(b, t)), 0).astype(np.int32)
  loss_mask = valid & (np.arange(t)[None, :] >= 4)
  zeros = np.zeros((b, t), np.float32)
  rb = batches.RolloutBatch.create(
    tokens_BxT=tokens,
    positions_BxT=(np.arange(t)[None, :] * valid).astype(np.int32),
    valid_BxT=valid,
    loss_mask_BxT=loss_mask,
    sampler_logps_BxT=zeros,
    rewards_B=rng.normal(size=b).astype(np.float32),
    group_ids_B=np.zeros(b, np.int32),
  )
  sb = batches.ScoredBatch.from_rollout(rb, ref_logps_BxT=zeros - 1.0, old_logps_BxT=zeros)
  adv = np.where(loss_mask, rng.normal(size=(b, t)), 0).astype(np.float32)
  return batches.AdvantageBatch.from_scored(sb, advantages_BxT=adv, returns_BxT=adv)


def _one_update(cfg: config_lib.ExperimentConfig, model_cfg: config_lib.ModelConfig):
  _, model = from_pretrained(cfg.pretrained_path, model_cfg)
  graphdef, params = nnx.split(model)
  obj = objective.Objective(cfg.rl.loss, chunk_size=8, old_from_new=True)
  batch = _batch()
  grads = jax.jit(jax.grad(lambda p: obj(nnx.merge(graphdef, p), batch, obj.totals(batch))[0]))(
    params
  )
  optimizer = update.make_optimizer(cfg.optim)
  state = update.init_train_state(params, optimizer, jax.random.key(0))
  before = jax.tree.map(np.asarray, params)
  step = lambda s, b: update.update_step(  # noqa: E731
    graphdef, s, b, loss_fn=obj, totals_fn=obj.totals, optimizer=optimizer
  )
  state, _ = jax.jit(step)(state, batch)
  return before, jax.tree.map(np.asarray, grads), state


def _adamw_first_step(w, g, norm, o: update.OptimConfig):
  """optax clip_by_global_norm + adamw, first step, in float64."""
  w, g = w.astype(np.float64), g.astype(np.float64)
  g = g * min(1.0, o.max_grad_norm / norm)
  m_hat, v_hat = g, g * g  # bias-corrected first moments after one step
  return w - o.learning_rate * (m_hat / (np.sqrt(v_hat) + o.eps) + o.weight_decay * w)


def test_shipped_qwen_settings_are_f32_master_bf16_compute(checkpoint):
  cfg = _experiment(checkpoint)
  assert cfg.model.param_dtype == DType.FLOAT32 and cfg.model.compute_dtype == DType.BFLOAT16
  assert cfg.optim.learning_rate == 1e-6


def test_one_update_at_lr_1e6_matches_float64_adamw(checkpoint):
  cfg = _experiment(checkpoint)
  before, grads, state = _one_update(cfg, cfg.model)
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert moments and all(x.dtype == jnp.float32 for x in moments)  # Adam moments are f32 too
  norm = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in jax.tree.leaves(grads))))
  flat_w = nnx.to_flat_state(before)
  flat_g = dict(nnx.to_flat_state(grads))
  flat_new = dict(nnx.to_flat_state(jax.tree.map(np.asarray, state.params)))
  for path, w in flat_w:
    w, g, new = w.get_value(), flat_g[path].get_value(), flat_new[path].get_value()
    assert new.dtype == np.float32
    moving = np.abs(g) > 1e-6  # Adam's step is ~lr wherever |g| >> eps
    assert moving.any(), path
    assert np.all(new[moving] != w[moving]), path  # every weight with a gradient moved
    want = _adamw_first_step(w, g, norm, cfg.optim)
    # f32 rounding of w - step: an ulp of the larger of the two operands
    ulp = np.spacing(np.maximum(np.abs(w), np.abs(want)).astype(np.float32)).astype(np.float64)
    # The reference gradient comes from a separately compiled bf16-compute program: bf16 rounding
    # (up to ~1e-2 relative) moves Adam's step g / (|g| + eps) only through eps / |g|.
    # optax's f32 moments carry (1 - b2) = 1 - f32(0.999), a ~1e-5 relative error of the step.
    lr, eps = cfg.optim.learning_rate, cfg.optim.eps
    noise = lr * 1e-2 * eps / np.maximum(np.abs(g), eps) + 1e-4 * lr
    np.testing.assert_array_less(np.abs(new - want), 2 * ulp + noise, err_msg=str(path))


def test_pure_bf16_would_not_move_the_weights_and_is_warned_about(checkpoint):
  cfg = _experiment(checkpoint)
  bf16 = dataclasses.replace(cfg.model, param_dtype=DType.BFLOAT16)
  before, grads, state = _one_update(cfg, bf16)
  moved = total = 0
  for w, g, new in zip(*(jax.tree.leaves(x) for x in (before, grads, state.params))):
    moving = np.abs(np.asarray(g, np.float32)) > 1e-6
    moved += int(np.sum(np.asarray(new)[moving] != w[moving]))
    total += int(moving.sum())
  assert moved < 0.1 * total, (moved, total)  # the bug the f32 master weights fix
  c = connect_four_qwen2_5_0_5b.get_config()
  c.model.param_dtype = "bfloat16"
  with pytest.warns(UserWarning, match="param_dtype='bfloat16'.*learning_rate=1e-06"):
    config_lib.from_config_dict(c)
