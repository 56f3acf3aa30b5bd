"""Parity of imported HF checkpoints with transformers (torch CPU), and import errors."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from flax import nnx

from earl_jax.config_lib import ConfigError
from earl_jax.model import CheckpointError, from_pretrained, logits, model_config_from_hf
from earl_jax.model.config import ModelConfig, RopeType
from earl_jax.model.transformer import PAD_LOGIT, Decoder
from earl_jax.types import DType

_VOCAB = 97  # not a multiple of 128: exercises the padded vocab
_BASE = dict(
  vocab_size=_VOCAB,
  hidden_size=48,
  intermediate_size=80,
  num_hidden_layers=2,
  num_attention_heads=6,
  num_key_value_heads=2,
  max_position_embeddings=64,
  rms_norm_eps=1e-5,
)
_LLAMA3_ROPE = dict(
  rope_type="llama3",
  rope_theta=500000.0,
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=512,  # puts the 4 frequencies of Dh=8 in all three bands
)


def _save_hf(
  path, arch: str, *, save_dtype=None, max_shard_size=None, **overrides
) -> torch.nn.Module:
  """A tiny random HF model saved to ``path``; every weight (biases, norms too) is random."""
  cls_cfg, cls_model = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
  }[arch]
  config = cls_cfg(**{**_BASE, **overrides}, attn_implementation="eager")
  torch.manual_seed(0)
  model = cls_model(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.5)
  if save_dtype is not None:
    model = model.to(save_dtype)
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(path, **kwargs)
  return model


def _hf_logits(model_dir, tokens: np.ndarray) -> np.ndarray:
  model = transformers.AutoModelForCausalLM.from_pretrained(
    model_dir, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  with torch.no_grad():
    return model(torch.as_tensor(tokens)).logits.numpy()


def _tokens(b: int = 2, t: int = 11) -> np.ndarray:
  return np.random.default_rng(0).integers(0, _VOCAB, (b, t)).astype(np.int32)


_CASES = {
  "qwen2_gqa_bias_untied": ("qwen2", {}),
  "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
  "llama_gqa_llama3_rope": (
    "llama",
    {"rope_parameters": _LLAMA3_ROPE, "max_position_embeddings": 2048},
  ),
  "llama_mha_tied_head_dim": (
    "llama",
    {"num_key_value_heads": 6, "head_dim": 12, "tie_word_embeddings": True},
  ),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_logits_match_transformers(tmp_path, case):
  arch, overrides = _CASES[case]
  _save_hf(tmp_path, arch, **overrides)
  cfg, model = from_pretrained(str(tmp_path))
  assert cfg.qkv_bias == (arch == "qwen2")
  assert cfg.tie_embeddings == overrides.get("tie_word_embeddings", False)
  assert (model.lm_head is None) == cfg.tie_embeddings
  tokens = _tokens()
  ours = np.asarray(jax.jit(logits)(model, tokens))
  assert ours.shape == (2, 11, _VOCAB)
  np.testing.assert_allclose(ours, _hf_logits(tmp_path, tokens), atol=1e-4, rtol=0)


def test_llama3_rope_config_read(tmp_path):
  _save_hf(tmp_path, "llama", rope_parameters=_LLAMA3_ROPE, max_position_embeddings=2048)
  cfg, _ = from_pretrained(str(tmp_path))
  assert cfg.rope.type == RopeType.LLAMA3
  assert (cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (
    500000.0,
    8.0,
    512,
  )


def test_bf16_checkpoint_loaded_as_f32(tmp_path):
  _save_hf(tmp_path, "qwen2", save_dtype=torch.bfloat16)
  with safetensors.safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as fp:
    assert fp.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
  cfg, model = from_pretrained(str(tmp_path), ModelConfig(compute_dtype=DType.BFLOAT16))
  assert model.embed[...].dtype == np.float32 and cfg.param_dtype == DType.FLOAT32
  assert cfg.compute_dtype == DType.BFLOAT16  # the checkpoint's dtype never overrides a setting
  cfg = dataclasses.replace(cfg, compute_dtype=DType.FLOAT32)
  model = nnx.merge(nnx.graphdef(Decoder(cfg, rngs=nnx.Rngs(0))), nnx.state(model))
  tokens = _tokens()
  np.testing.assert_allclose(
    np.asarray(logits(model, tokens)), _hf_logits(tmp_path, tokens), atol=1e-4, rtol=0
  )


def test_sharded_checkpoint(tmp_path):
  _save_hf(tmp_path, "llama", max_shard_size="20KB")
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  assert not (tmp_path / "model.safetensors").exists()
  _, model = from_pretrained(str(tmp_path))
  tokens = _tokens()
  np.testing.assert_allclose(
    np.asarray(logits(model, tokens)), _hf_logits(tmp_path, tokens), atol=1e-4, rtol=0
  )


def test_padded_vocab_masked_and_bf16_load(tmp_path):
  _save_hf(tmp_path, "qwen2")
  settings = ModelConfig(
    param_dtype=DType.BFLOAT16, compute_dtype=DType.BFLOAT16, vocab_multiple=64
  )
  cfg, model = from_pretrained(str(tmp_path), settings)
  assert cfg.padded_vocab_size == 128 and model.embed[...].shape == (128, 48)
  assert model.embed[...].dtype == jax.numpy.bfloat16
  out, _ = model(_tokens(), np.zeros((2, 11), np.int32), mask_BxT=np.ones((2, 11), bool))
  assert out.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(out[..., _VOCAB:]), PAD_LOGIT)
  assert np.all(np.asarray(out[..., :_VOCAB]) > PAD_LOGIT / 2)


# ----------------------------------------------------------------------------------------------
# Config reading and errors


def test_model_config_transformers4_spelling_equals_rope_parameters():
  new = {**_BASE, "architectures": ["LlamaForCausalLM"], "rope_parameters": _LLAMA3_ROPE}
  old_scaling = {k: v for k, v in _LLAMA3_ROPE.items() if k != "rope_theta"}
  old = {**_BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0}
  old["rope_scaling"] = old_scaling
  assert model_config_from_hf(new) == model_config_from_hf(old)
  plain = model_config_from_hf({**_BASE, "model_type": "qwen2", "rope_theta": 1e6})
  assert plain.rope.type == RopeType.DEFAULT and plain.rope.theta == 1e6 and plain.qkv_bias


def _edit_config(path, **changes) -> None:
  config = json.loads((path / "config.json").read_text())
  config.update(changes)
  (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
  ("changes", "message"),
  [
    ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "'yarn'"),
    ({"intermediate_size": 96}, r"model\.layers\.0\.mlp\.\w+_proj\.weight .* has shape"),
  ],
)
def test_config_errors(tmp_path, changes, message):
  _save_hf(tmp_path, "qwen2")
  _edit_config(tmp_path, **changes)
  with pytest.raises(CheckpointError, match=message):
    from_pretrained(str(tmp_path))


def test_missing_tensor(tmp_path):
  _save_hf(tmp_path, "qwen2")
  file = os.path.join(tmp_path, "model.safetensors")
  tensors = safetensors.torch.load_file(file)
  del tensors["model.layers.1.self_attn.k_proj.bias"]
  safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(CheckpointError, match=r"missing tensor\(s\).*layers\.1\.self_attn\.k_proj"):
    from_pretrained(str(tmp_path))


def test_not_a_directory_nor_repo_id(tmp_path):
  with pytest.raises(CheckpointError, match="not a local directory"):
    from_pretrained(str(tmp_path / "nope"))


def test_set_architecture_key_that_disagrees_is_an_error(tmp_path):
  _save_hf(tmp_path, "qwen2")
  loaded, _ = from_pretrained(str(tmp_path))
  agree = ModelConfig(num_layers=loaded.num_layers, compute_dtype=DType.BFLOAT16)
  assert from_pretrained(str(tmp_path), agree)[0].num_layers == loaded.num_layers
  with pytest.raises(ConfigError, match=r"'model\.num_layers' has value 7.*config\.json"):
    from_pretrained(str(tmp_path), ModelConfig(num_layers=7))


def test_hub_repo_id_goes_through_snapshot_download(tmp_path, monkeypatch):
  import huggingface_hub

  _save_hf(tmp_path, "qwen2")
  calls = []

  def fake_download(repo_id: str, allow_patterns: list[str]) -> str:
    calls.append((repo_id, allow_patterns))
    return str(tmp_path)

  monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
  cfg, _ = from_pretrained("Qwen/Qwen2-Tiny-Test")
  assert cfg.vocab_size == _VOCAB
  assert calls[0][0] == "Qwen/Qwen2-Tiny-Test" and "*.safetensors" in calls[0][1]
