"""Export to Hugging Face format: transformers loads what save_pretrained writes, same logits."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import transformers

from earl_jax.model import from_pretrained, logits, model_config_from_hf, save_pretrained
from earl_jax.model.hf_export import hf_config
from earl_jax.model.hf_import import ARCHITECTURE_KEYS
from tests.model.hf_import_test import _CASES, _hf_logits, _save_hf, _tokens
from tests.model.tokenizer_test import backend, hf_dir  # noqa: F401  (pytest fixtures)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_export_loads_in_transformers_with_equal_logits(tmp_path, case):
  arch, overrides = _CASES[case]
  _save_hf(tmp_path / "src", arch, **overrides)
  cfg, model = from_pretrained(str(tmp_path / "src"))
  files = save_pretrained(model, str(tmp_path / "out"))
  assert files == ["config.json", "model.safetensors"]
  tokens = _tokens()
  ours = np.asarray(jax.jit(logits)(model, tokens))
  np.testing.assert_allclose(_hf_logits(tmp_path / "out", tokens), ours, atol=1e-5, rtol=0)
  exported = json.loads((tmp_path / "out" / "config.json").read_text())
  back = model_config_from_hf(exported)
  assert {k: getattr(back, k) for k in ARCHITECTURE_KEYS} == {
    k: getattr(cfg, k) for k in ARCHITECTURE_KEYS
  }


def test_bf16_export_in_shards_reimports_exactly(tmp_path):
  _save_hf(tmp_path / "src", "qwen2")
  _, model = from_pretrained(str(tmp_path / "src"))
  files = save_pretrained(model, str(tmp_path / "out"), dtype="bfloat16", max_shard_bytes=20_000)
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
  assert sorted(set(index["weight_map"].values())) == sorted(shards)
  assert not list((tmp_path / "out").glob(".export-part-*"))
  assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  # The bf16 checkpoint: transformers and our own import of it compute the same logits.
  _, again = from_pretrained(str(tmp_path / "out"))
  tokens = _tokens()
  ours = np.asarray(jax.jit(logits)(again, tokens))
  np.testing.assert_allclose(_hf_logits(tmp_path / "out", tokens), ours, atol=1e-5, rtol=0)


def test_tokenizer_files_and_base_config_carried_over(tmp_path, hf_dir):  # noqa: F811
  _save_hf(tmp_path / "src", "qwen2", bos_token_id=5, eos_token_id=7)
  _, model = from_pretrained(str(tmp_path / "src"))
  base = json.loads((tmp_path / "src" / "config.json").read_text())
  files = save_pretrained(model, str(tmp_path / "out"), tokenizer_dir=hf_dir, base_config=base)
  assert "tokenizer.json" in files and (tmp_path / "out" / "tokenizer.json").exists()
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  want = transformers.AutoTokenizer.from_pretrained(hf_dir)
  assert tok("hello there")["input_ids"] == want("hello there")["input_ids"]
  exported = json.loads((tmp_path / "out" / "config.json").read_text())
  assert (exported["bos_token_id"], exported["eos_token_id"]) == (5, 7)


def test_unknown_dtype_is_refused_before_writing(tmp_path):
  _save_hf(tmp_path / "src", "llama")
  _, model = from_pretrained(str(tmp_path / "src"))
  with pytest.raises(ValueError, match="dtype='int8'; allowed"):
    save_pretrained(model, str(tmp_path / "out"), dtype="int8")
  assert not (tmp_path / "out").exists()


def test_hf_config_keeps_llama3_rope():
  from tests.model.hf_import_test import _BASE, _LLAMA3_ROPE

  hf = {**_BASE, "model_type": "llama", "rope_parameters": _LLAMA3_ROPE}
  cfg = model_config_from_hf({**hf, "max_position_embeddings": 2048})
  assert model_config_from_hf(hf_config(cfg, "float32")).rope == cfg.rope
