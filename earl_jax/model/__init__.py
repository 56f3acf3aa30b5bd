"""earl_jax.model: the Llama/Qwen2-family policy decoder, its KV cache, HF checkpoint import and
export, tokenizers."""

from earl_jax.model.hf_export import save_pretrained
from earl_jax.model.hf_import import (
  CheckpointError,
  from_pretrained,
  model_config_from_hf,
  read_config,
)
from earl_jax.model.kv_cache import (
  CACHE_END_AXES,
  CACHE_KV_AXES,
  CACHE_VALID_AXES,
  KVCache,
  cache_partition_specs,
  init_cache,
  resize_cache,
)
from earl_jax.model.tokenizer import (
  CharTokenizer,
  HFTokenizer,
  Tokenizer,
  TokenizerError,
  make_tokenizer,
)
from earl_jax.model.transformer import PAD_LOGIT, Decoder, decode_step, logits, prefill

__all__ = [
  "CACHE_END_AXES",
  "CACHE_KV_AXES",
  "CACHE_VALID_AXES",
  "PAD_LOGIT",
  "CharTokenizer",
  "CheckpointError",
  "Decoder",
  "HFTokenizer",
  "KVCache",
  "Tokenizer",
  "TokenizerError",
  "cache_partition_specs",
  "decode_step",
  "from_pretrained",
  "init_cache",
  "logits",
  "make_tokenizer",
  "model_config_from_hf",
  "prefill",
  "read_config",
  "resize_cache",
  "save_pretrained",
]
