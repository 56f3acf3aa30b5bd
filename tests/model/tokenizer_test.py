"""Tokenizers: HFTokenizer parity with transformers on a locally trained BPE; CharTokenizer."""

from __future__ import annotations

import json
import os
import random

import jinja2
import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from earl_jax.model.config import TokenizerConfig, TokenizerKind
from earl_jax.model.tokenizer import (
  CHAR_ALPHABET,
  CHAR_SPECIAL_TOKENS,
  HF_TOKENIZER_FILES,
  CharTokenizer,
  HFTokenizer,
  Tokenizer,
  TokenizerError,
  make_tokenizer,
)

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5-Instruct's template (tool-call branch shortened): dash whitespace control, tojson, tools.
_QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# No dash control: output depends on trim_blocks/lstrip_blocks; uses bos/eos and raise_exception.
_PLAIN_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
  {% if message['role'] not in ['user', 'assistant', 'system'] %}
    {{ raise_exception('unsupported role ' + message['role']) }}
  {% endif %}
  {% if loop.index0 > 9 %}{% break %}{% endif %}
[{{ message['role'] }}]: {{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
[assistant]:{% endif %}"""

_CHATS = [
  [{"role": "user", "content": "hello there"}],
  [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Play column 3?"},
    {"role": "assistant", "content": "I play 3."},
    {"role": "user", "content": "héllo wörld 日本 🙂"},
  ],
  [
    {"role": "user", "content": "look it up"},
    {"role": "assistant", "content": "<tool_call>x</tool_call>"},
    {"role": "tool", "content": '{"r": 1}'},
    {"role": "tool", "content": "two"},
  ],
]

_TEXTS = [
  "",
  "hello world",
  "  leading and trailing spaces  \n\ttab",
  "héllo wörld, naïve café",
  "日本語のテキスト",
  "emoji 🙂🚀 and ∑ math",
  "<|im_start|>user\nhi<|im_end|>\n",
  "text<|endoftext|>more",
]


def _corpus() -> list[str]:
  words = ["the", "a", "move", "column", "row", "win", "draw", "board", "token", "agent"]
  rng = random.Random(0)
  lines = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(300)]
  return [*lines, "héllo wörld café naïve", "日本 語", "<tool_call> </tool_call> {} [] :"]


def _trained_backend() -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=400,
    special_tokens=_SPECIALS,
    show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(_corpus(), trainer=trainer)
  return tok


@pytest.fixture(scope="module")
def backend() -> tokenizers.Tokenizer:
  return _trained_backend()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, backend: tokenizers.Tokenizer) -> str:
  """A Qwen2-style tokenizer saved by transformers, plus generation_config eos ids."""
  directory = str(tmp_path_factory.mktemp("qwen_like"))
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    clean_up_tokenization_spaces=False,
  )
  fast.chat_template = _QWEN_TEMPLATE
  fast.save_pretrained(directory)
  eos = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
  with open(os.path.join(directory, "generation_config.json"), "w") as fp:
    json.dump({"eos_token_id": eos}, fp)
  return directory


@pytest.fixture(scope="module")
def reference(hf_dir: str) -> transformers.PreTrainedTokenizerBase:
  return transformers.AutoTokenizer.from_pretrained(hf_dir)


def _write_dir(directory: str, backend: tokenizers.Tokenizer, config: dict) -> str:
  os.makedirs(directory, exist_ok=True)
  backend.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as fp:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **config}, fp)
  return directory


# ----------------------------------------------------------------------------------------------
# HFTokenizer


def test_hf_encode_decode_match_transformers(hf_dir: str, reference) -> None:
  tok = HFTokenizer.from_pretrained(hf_dir)
  assert tok.vocab_size == len(reference) == len(tok.backend.get_vocab(with_added_tokens=True))
  for text in _TEXTS:
    ids = tok.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False), text
    assert tok.encode(text, add_special_tokens=True) == reference.encode(text), text
    assert tok.decode(ids) == reference.decode([i for i in ids if i != tok.pad_id]), text
  # Byte-level BPE is lossless on any text; chat control tokens encode to one id.
  assert tok.decode(tok.encode(_TEXTS[5])) == _TEXTS[5]
  assert tok.encode("<|im_end|>") == [tok.token_id("<|im_end|>")]


def test_hf_chat_template_matches_transformers(hf_dir: str, reference) -> None:
  assert os.path.exists(os.path.join(hf_dir, "chat_template.jinja"))  # transformers 5 layout
  tok = HFTokenizer.from_pretrained(hf_dir)
  for chat in _CHATS:
    for gen in (False, True):
      want = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
      got = tok.apply_chat_template(chat, add_generation_prompt=gen)
      assert got == want
      assert tok.encode_chat(chat, add_generation_prompt=gen) == reference.encode(
        want, add_special_tokens=False
      )
  prompt = tok.apply_chat_template(_CHATS[0], add_generation_prompt=True)
  assert prompt.endswith("<|im_start|>assistant\n")


def test_hf_special_and_stop_ids(hf_dir: str, reference) -> None:
  tok = HFTokenizer.from_pretrained(hf_dir)
  im_end, eot = tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")
  assert (tok.eos_id, tok.pad_id, tok.bos_id) == (im_end, eot, None)
  assert tok.eos_id == reference.eos_token_id and tok.pad_id == reference.pad_token_id
  assert tok.stop_ids == (im_end, eot)
  assert isinstance(tok, Tokenizer)
  # pad is dropped by decode; other special tokens only with skip_special_tokens.
  ids = [*tok.encode("hi"), im_end, eot, eot]
  assert tok.decode(ids) == "hi<|im_end|>"
  assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_hf_decode_never_raises_in_range(hf_dir: str) -> None:
  tok = HFTokenizer.from_pretrained(hf_dir)
  ids = tok.encode("🙂")  # unseen in training: one id per UTF-8 byte
  assert len(ids) == 4
  for cut in range(1, 4):
    assert "\ufffd" in tok.decode(ids[:cut])
  assert tok.decode(ids) == "🙂"
  rng = random.Random(1)
  for _ in range(200):
    tok.decode([rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))])
  n = tok.vocab_size
  with pytest.raises(ValueError, match=rf"\[{n}\] are outside \[0, {n}\)"):
    tok.decode([1, n])
  with pytest.raises(ValueError, match="outside"):
    tok.decode([-1])


def test_hf_named_templates_and_dict_tokens(tmp_path, backend) -> None:
  """tokenizer_config.json with a list of named templates and AddedToken-dict special tokens."""
  added = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
  config = {
    "bos_token": "<|im_start|>",
    "eos_token": added,
    "chat_template": [
      {"name": "default", "template": _QWEN_TEMPLATE},
      {"name": "plain", "template": _PLAIN_TEMPLATE},
    ],
  }
  directory = _write_dir(str(tmp_path / "named"), backend, config)
  reference = transformers.AutoTokenizer.from_pretrained(directory)
  tok = HFTokenizer.from_pretrained(directory, chat_template_name="plain")
  assert tok.bos_id == tok.token_id("<|im_start|>") and tok.eos_id == tok.token_id("<|im_end|>")
  assert tok.pad_id == tok.eos_id  # no pad token: falls back to eos
  for chat in _CHATS[:2]:
    for gen in (False, True):
      kw = dict(tokenize=False, add_generation_prompt=gen)
      assert tok.apply_chat_template(chat, add_generation_prompt=gen) == (
        reference.apply_chat_template(chat, chat_template="plain", **kw)
      )
      assert HFTokenizer.from_pretrained(directory).apply_chat_template(
        chat, add_generation_prompt=gen
      ) == reference.apply_chat_template(chat, **kw)
  with pytest.raises(jinja2.exceptions.TemplateError, match="unsupported role tool"):
    tok.apply_chat_template(_CHATS[2], add_generation_prompt=False)
  missing = HFTokenizer.from_pretrained(directory, chat_template_name="nope")
  with pytest.raises(TokenizerError, match=r"'nope' not found; available: \['default', 'plain'\]"):
    missing.apply_chat_template(_CHATS[0], add_generation_prompt=True)


def test_hf_post_processor_bos_only_when_asked(tmp_path) -> None:
  """Llama-3 style: the post-processor prepends bos; encode adds it only with add_special_tokens."""
  backend = _trained_backend()
  bos = backend.token_to_id("<|im_start|>")
  backend.post_processor = processors.TemplateProcessing(
    single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
  )
  config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
  directory = _write_dir(str(tmp_path / "bos"), backend, config)
  reference = transformers.AutoTokenizer.from_pretrained(directory)
  tok = HFTokenizer.from_pretrained(directory)
  for text in _TEXTS:
    assert tok.encode(text, add_special_tokens=True) == reference.encode(text), text
    assert tok.encode(text, add_special_tokens=True) == [bos, *tok.encode(text)], text


def test_hf_errors(tmp_path, backend) -> None:
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "config.json").write_text("{}")
  with pytest.raises(TokenizerError, match=r"has no tokenizer.json \(found \['config.json'\]\)"):
    HFTokenizer.from_pretrained(str(tmp_path / "empty"))
  with pytest.raises(TokenizerError, match="not a local directory, nor a hub repo id"):
    HFTokenizer.from_pretrained(str(tmp_path / "does" / "not" / "exist"))
  bare = _write_dir(str(tmp_path / "bare"), backend, {"eos_token": "<|endoftext|>"})
  tok = HFTokenizer.from_pretrained(bare)
  assert tok.stop_ids == (tok.eos_id, tok.token_id("<|im_end|>"))
  with pytest.raises(TokenizerError, match="no chat template"):
    tok.encode_chat(_CHATS[0], add_generation_prompt=True)
  no_eos = _write_dir(str(tmp_path / "no_eos"), backend, {})
  with pytest.raises(TokenizerError, match="no eos token"):
    HFTokenizer.from_pretrained(no_eos)
  bad = _write_dir(str(tmp_path / "bad"), backend, {"eos_token": "<|missing|>"})
  with pytest.raises(TokenizerError, match=r"'<\|missing\|>' is not in the vocabulary"):
    HFTokenizer.from_pretrained(bad)


def test_hf_hub_repo_id_downloads_tokenizer_files_only(monkeypatch, hf_dir: str) -> None:
  import huggingface_hub

  calls = []

  def fake_snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
    calls.append((repo_id, allow_patterns))
    return hf_dir

  monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
  tok = make_tokenizer(TokenizerConfig(kind=TokenizerKind.HF, path="Qwen/Qwen2.5-0.5B-Instruct"))
  assert isinstance(tok, HFTokenizer) and tok.vocab_size > 300
  assert calls == [("Qwen/Qwen2.5-0.5B-Instruct", list(HF_TOKENIZER_FILES))]
  assert not any("safetensors" in p for p in HF_TOKENIZER_FILES)


# ----------------------------------------------------------------------------------------------
# CharTokenizer


def test_char_vocabulary_is_deterministic_and_small() -> None:
  tok = CharTokenizer()
  assert tok.vocab_size == len(CHAR_SPECIAL_TOKENS) + len(CHAR_ALPHABET) == 105 < 128
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
  assert tok.stop_ids == (tok.eos_id, tok.token_id("<end>"))
  assert [tok.token_id(t) for t in CHAR_SPECIAL_TOKENS] == list(range(len(CHAR_SPECIAL_TOKENS)))
  assert tok.encode(" ~\n") == [9, 9 + 94, 9 + 95]
  assert isinstance(tok, Tokenizer)


def test_char_round_trip_unknown_and_specials() -> None:
  tok = CharTokenizer()
  assert tok.decode(tok.encode(CHAR_ALPHABET)) == CHAR_ALPHABET
  rng = random.Random(2)
  pieces = [*CHAR_ALPHABET, "<end>", "<usr>", "<pad>", "<unk>", "<", "<asst", ">"]
  for _ in range(200):
    text = "".join(rng.choice(pieces) for _ in range(rng.randrange(30)))
    assert tok.decode(tok.encode(text)) == text
  assert tok.encode("<usr>a<end>") == [tok.token_id("<usr>"), tok.token_id("a"), tok.end_id]
  assert len(tok.encode("<pad><unk>")) == 10  # literal, not parsed: they would not round trip
  assert tok.encode("é\tß") == [tok.unk_id] * 3
  assert tok.decode(tok.encode("aé")) == "a\ufffd"
  assert tok.encode("ab", add_special_tokens=True) == [tok.bos_id, *tok.encode("ab")]
  assert tok.decode([0, *tok.encode("x"), 0]) == "x"  # pad dropped
  assert tok.decode(tok.encode("<usr>hi<end>"), skip_special_tokens=True) == "hi"


def test_char_decode_never_raises_in_range() -> None:
  tok = CharTokenizer()
  rng = random.Random(3)
  for _ in range(200):
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(20))]
    assert tok.decode(np.asarray(ids, np.int32)) == tok.decode(ids)  # rollout rows are arrays
  with pytest.raises(ValueError, match=r"\[105\] are outside \[0, 105\)"):
    tok.decode([5, 105])


def test_char_chat_format() -> None:
  tok = CharTokenizer()
  chat = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "move?"},
    {"role": "assistant", "content": "3"},
    {"role": "tool", "content": "ok"},
  ]
  text = tok.apply_chat_template(chat, add_generation_prompt=False)
  assert text == "<bos><sys>sys<end><usr>move?<end><asst>3<end><tool>ok<end>"
  prompt = tok.apply_chat_template(chat[:2], add_generation_prompt=True)
  assert prompt == "<bos><sys>sys<end><usr>move?<end><asst>"
  ids = tok.encode_chat(chat, add_generation_prompt=False)
  assert ids == tok.encode(text) and tok.decode(ids) == text
  # Each turn extends the previous rendering, so a rollout can append per-turn ids.
  for k in range(len(chat)):
    shorter = tok.encode_chat(chat[:k], add_generation_prompt=False)
    assert ids[: len(shorter)] == shorter
  with pytest.raises(TokenizerError, match=r"role 'narrator'; CharTokenizer allows"):
    tok.apply_chat_template([{"role": "narrator", "content": "x"}], add_generation_prompt=False)


def test_make_tokenizer_char() -> None:
  assert isinstance(make_tokenizer(TokenizerConfig()), CharTokenizer)
