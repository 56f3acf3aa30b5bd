"""Tokenizers: text <-> token ids for prompts, environment turns and decoded completions.

Data flow: ``rl.rollout`` and the environments sit on the host side of the rollout stage. The
rollout loop is token-in/token-out: it renders the first prompt with ``encode_chat``, then, turn
by turn, decodes the sampled completion (``decode``) for the environment, tokenises the
environment's reply once (``encode``) and appends those ids to the running sequence; it never
re-tokenises text it has already turned into ids. A turn ends when the sampler emits one of
``stop_ids``.

Two implementations of the ``Tokenizer`` protocol:

* ``CharTokenizer``: built in, needs no files; one id per character, for tiny from-scratch models.
* ``HFTokenizer``: a Hugging Face ``tokenizer.json`` (via the ``tokenizers`` library) with the
  chat template, special tokens and generation-config eos ids of the same checkpoint directory;
  ids and chat renderings match ``transformers.AutoTokenizer`` for the same files.

Guarantees common to both:

* ``encode`` adds no special tokens unless ``add_special_tokens=True``; special-token *text* in the
  input (``<|im_end|>``, ``<end>``) is parsed as the special id, as Hugging Face tokenizers do, so
  a rendered chat template encodes to its control ids. Content that quotes a control token will
  therefore become that control token (no sanitisation, like transformers' default).
* ``decode`` drops ``pad_id`` always and every special token when ``skip_special_tokens=True``.
  It never raises on ids in ``[0, vocab_size)``: bytes that do not form valid UTF-8 (a completion
  cut inside a multi-byte character) become U+FFFD. Ids outside that range raise ``ValueError``.
* ``encode_chat(m, ...) == encode(apply_chat_template(m, ...))``.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from earl_jax.model.config import TokenizerConfig, TokenizerKind

Message = Mapping[str, str]


class TokenizerError(ValueError):
  """Tokenizer files are missing or inconsistent, or a request (chat template, id) is invalid."""


@runtime_checkable
class Tokenizer(Protocol):
  """What the rollout loop and the environments need from a tokenizer (see module docstring)."""

  vocab_size: int  # every id is in [0, vocab_size)
  eos_id: int
  pad_id: int
  bos_id: int | None
  stop_ids: tuple[int, ...]  # ids that end an assistant turn; eos_id first

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

  def apply_chat_template(
    self, messages: Sequence[Message], *, add_generation_prompt: bool
  ) -> str: ...

  def encode_chat(
    self, messages: Sequence[Message], *, add_generation_prompt: bool
  ) -> list[int]: ...


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
  out = [int(i) for i in ids]
  bad = [i for i in out if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"token ids {bad[:8]} are outside [0, {vocab_size}) of this tokenizer")
  return out


# ----------------------------------------------------------------------------------------------
# Character tokenizer

# Order fixes the ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then the role markers.
CHAR_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>", "<sys>", "<usr>", "<asst>", "<tool>")
CHAR_SPECIAL_TOKENS += ("<end>",)
CHAR_ALPHABET = "".join(chr(c) for c in range(ord(" "), ord("~") + 1)) + "\n"
_CHAR_ROLE_MARKERS = {"system": "<sys>", "user": "<usr>", "assistant": "<asst>", "tool": "<tool>"}
# Text spelling these is parsed as the special id. <pad> and <unk> are not: literal "<pad>" or
# "<unk>" stays plain characters, so it survives decode (which drops pad and shows unk as U+FFFD).
_CHAR_CONTROL_TOKENS = ("<bos>", "<eos>", "<sys>", "<usr>", "<asst>", "<tool>", "<end>")


class CharTokenizer:
  """One id per character of ``CHAR_ALPHABET`` (printable ASCII and newline) plus special tokens.

  Vocabulary (105 ids): ``CHAR_SPECIAL_TOKENS`` at ids 0..8 (``<pad>``, ``<bos>``, ``<eos>``,
  ``<unk>``, ``<sys>``, ``<usr>``, ``<asst>``, ``<tool>``, ``<end>``), then the characters
  ``' '..'~'`` and ``'\\n'`` in that order.

  * ``decode(encode(s)) == s`` for every ``s`` made of ``CHAR_ALPHABET``, including strings that
    spell control tokens. Other characters encode to ``<unk>``, which decodes to U+FFFD.
  * Chat format (compact, no whitespace added)::

      <bos><sys>{system}<end><usr>{user}<end><asst>{assistant}<end><tool>{tool}<end>...

    with ``<asst>`` appended when ``add_generation_prompt``. The model ends its turn with
    ``<end>`` (or ``<eos>``): ``stop_ids == (eos_id, end_id)``. Rendering ``messages[:k+1]``
    extends rendering ``messages[:k]``, so a multi-turn rollout can append each new turn's ids.
  """

  def __init__(self) -> None:
    self._id_to_piece = CHAR_SPECIAL_TOKENS + tuple(CHAR_ALPHABET)
    self._char_to_id = {c: i + len(CHAR_SPECIAL_TOKENS) for i, c in enumerate(CHAR_ALPHABET)}
    self._special_to_id = {tok: i for i, tok in enumerate(CHAR_SPECIAL_TOKENS)}
    self.vocab_size = len(self._id_to_piece)
    self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
    self.end_id = self._special_to_id["<end>"]
    self.stop_ids = (self.eos_id, self.end_id)

  def token_id(self, token: str) -> int:
    """Id of a special token (e.g. ``"<usr>"``) or of a single alphabet character."""
    found = self._special_to_id.get(token, self._char_to_id.get(token))
    if found is None:
      raise TokenizerError(f"{token!r} is neither a special token {CHAR_SPECIAL_TOKENS} nor a char")
    return found

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Ids of ``text``; ``add_special_tokens`` prepends ``<bos>``. Never raises."""
    ids = [self.bos_id] if add_special_tokens else []
    pos = 0
    while pos < len(text):
      if text[pos] == "<":
        # Control tokens all start with '<' and none is a prefix of another.
        token = next((t for t in _CHAR_CONTROL_TOKENS if text.startswith(t, pos)), None)
        if token is not None:
          ids.append(self._special_to_id[token])
          pos += len(token)
          continue
      ids.append(self._char_to_id.get(text[pos], self.unk_id))
      pos += 1
    return ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """Text of ``ids``: pad dropped, ``<unk>`` as U+FFFD, other specials as their text."""
    pieces = []
    for i in _check_ids(ids, self.vocab_size):
      if i == self.pad_id or (skip_special_tokens and i < len(CHAR_SPECIAL_TOKENS)):
        continue
      pieces.append("\ufffd" if i == self.unk_id else self._id_to_piece[i])
    return "".join(pieces)

  def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
    """The compact chat format of the class docstring."""
    parts = ["<bos>"]
    for index, message in enumerate(messages):
      role = message.get("role")
      if role not in _CHAR_ROLE_MARKERS:
        raise TokenizerError(
          f"message {index} has role {role!r}; CharTokenizer allows {sorted(_CHAR_ROLE_MARKERS)}"
        )
      parts.append(f"{_CHAR_ROLE_MARKERS[role]}{message.get('content', '')}<end>")
    if add_generation_prompt:
      parts.append("<asst>")
    return "".join(parts)

  def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> list[int]:
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return self.encode(text)


# ----------------------------------------------------------------------------------------------
# Chat templates, rendered like transformers.utils.chat_template_utils


class _GenerationTag(jinja2.ext.Extension):
  """Accepts ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) as plain text."""

  tags = {"generation"}  # noqa: RUF012  (jinja reads this class attribute)

  def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller: Any) -> str:
    return caller()


def _raise_exception(message: str) -> None:
  raise jinja2.exceptions.TemplateError(message)


def _tojson(
  x: Any,
  ensure_ascii: bool = False,
  indent: int | None = None,
  separators: tuple[str, str] | None = None,
  sort_keys: bool = False,
) -> str:
  # jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
  """The template in transformers' sandboxed environment (same options, filters and globals)."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


# ----------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json

# Files snapshot_download fetches for a hub repo id (no weights).
HF_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "generation_config.json",
  "chat_template.jinja",
  "additional_chat_templates/*.jinja",
)
# Added tokens that end an assistant turn in common chat formats (Qwen/ChatML, Llama 3, Phi,
# Gemma); each one present in the vocabulary joins stop_ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
END_OF_TURN_TOKENS += ("<|endoftext|>",)


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as fp:
    return json.load(fp)


def _token_text(value: Any, key: str) -> str | None:
  """tokenizer_config stores special tokens as a string or as an AddedToken dict with content."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  raise TokenizerError(f"tokenizer_config '{key}' is {value!r}; expected a string or {{content}}")


def resolve_tokenizer_dir(path: str) -> str:
  """A local directory as is; otherwise a hub repo id, downloading only ``HF_TOKENIZER_FILES``."""
  expanded = os.path.expanduser(path)
  if os.path.isdir(expanded):
    return expanded
  if os.path.exists(expanded) or expanded.startswith((os.sep, ".")) or path.count("/") != 1:
    raise TokenizerError(
      f"tokenizer path {path!r} is not a local directory, nor a hub repo id 'org/name'"
    )
  import huggingface_hub  # only needed for hub ids

  return huggingface_hub.snapshot_download(repo_id=path, allow_patterns=list(HF_TOKENIZER_FILES))


def load_chat_templates(directory: str, config: Mapping[str, Any]) -> dict[str, str]:
  """Named templates; like transformers, ``chat_template.jinja`` (and the files in
  ``additional_chat_templates/``) replace the ``chat_template`` of tokenizer_config.json."""
  files: dict[str, str] = {}
  single = os.path.join(directory, "chat_template.jinja")
  if os.path.exists(single):
    with open(single, encoding="utf-8") as fp:
      files["default"] = fp.read()
  extra_dir = os.path.join(directory, "additional_chat_templates")
  if os.path.isdir(extra_dir):
    for name in sorted(os.listdir(extra_dir)):
      if name.endswith(".jinja"):
        with open(os.path.join(extra_dir, name), encoding="utf-8") as fp:
          files[name.removesuffix(".jinja")] = fp.read()
  if files:
    return files
  value = config.get("chat_template")
  if value is None:
    return {}
  if isinstance(value, str):
    return {"default": value}
  if isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
    return {t["name"]: t["template"] for t in value}
  raise TokenizerError(f"tokenizer_config 'chat_template' is {type(value).__name__}; expected str")


def _eos_ids_from_generation_config(directory: str) -> list[int]:
  value = _read_json(os.path.join(directory, "generation_config.json")).get("eos_token_id")
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) for v in values):
    raise TokenizerError(f"generation_config 'eos_token_id' is {value!r}; expected int or ints")
  return values


class HFTokenizer:
  """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of its checkpoint.

  ``encode`` equals ``transformers`` ``tokenizer.encode(text, add_special_tokens=...)`` and
  ``apply_chat_template`` equals ``apply_chat_template(messages, tokenize=False, ...)``.
  ``decode`` is the backend's decode without transformers' ``clean_up_tokenization_spaces``
  (which rewrites e.g. ``" ."`` to ``"."`` and would break token-in/token-out text accounting).
  ``pad_id`` falls back to ``eos_id`` when the checkpoint defines no pad token (Llama 3); then
  ``decode`` drops eos too. ``stop_ids``: eos, the generation-config eos ids, and every
  ``END_OF_TURN_TOKENS`` entry in the vocabulary.
  """

  def __init__(
    self,
    backend: tokenizers.Tokenizer,
    *,
    eos_token: str | None,
    bos_token: str | None = None,
    pad_token: str | None = None,
    unk_token: str | None = None,
    chat_templates: Mapping[str, str] | None = None,
    chat_template_name: str | None = None,
    extra_eos_ids: Sequence[int] = (),
  ) -> None:
    self.backend = backend
    self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    self.chat_templates = dict(chat_templates or {})
    self.chat_template_name = chat_template_name
    # What templates see as bos_token/eos_token/...: only the tokens the checkpoint defines.
    named = {"bos_token": bos_token, "eos_token": eos_token}
    named |= {"unk_token": unk_token, "pad_token": pad_token}
    self.template_tokens = {k: v for k, v in named.items() if v is not None}
    extra = [int(i) for i in _check_ids(extra_eos_ids, self.vocab_size)]
    if eos_token is None and not extra:
      raise TokenizerError(
        "no eos token: set 'eos_token' in tokenizer_config.json or 'eos_token_id' in "
        "generation_config.json"
      )
    self.eos_id = self.token_id(eos_token) if eos_token is not None else extra[0]
    self.bos_id = self.token_id(bos_token) if bos_token is not None else None
    self.pad_id = self.token_id(pad_token) if pad_token is not None else self.eos_id
    turn_ends = [backend.token_to_id(t) for t in END_OF_TURN_TOKENS]
    stops = [self.eos_id, *extra, *(i for i in turn_ends if i is not None)]
    self.stop_ids = tuple(dict.fromkeys(stops))  # ordered, deduplicated

  @classmethod
  def from_pretrained(cls, path: str, *, chat_template_name: str | None = None) -> HFTokenizer:
    """From a directory (or hub repo id) holding ``tokenizer.json`` and optionally
    ``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json``,
    ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``."""
    directory = resolve_tokenizer_dir(path)
    tokenizer_file = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
      raise TokenizerError(
        f"{directory} has no tokenizer.json (found {sorted(os.listdir(directory))}); only fast "
        "(tokenizers-library) tokenizers are supported, re-save with transformers' "
        "PreTrainedTokenizerFast.save_pretrained"
      )
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    legacy = _read_json(os.path.join(directory, "special_tokens_map.json"))
    tokens = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
      tokens[key] = _token_text(config[key] if key in config else legacy.get(key), key)
    return cls(
      tokenizers.Tokenizer.from_file(tokenizer_file),
      **tokens,
      chat_templates=load_chat_templates(directory, config),
      chat_template_name=chat_template_name,
      extra_eos_ids=_eos_ids_from_generation_config(directory),
    )

  def token_id(self, token: str) -> int:
    """Id of a vocabulary entry (e.g. ``"<|im_end|>"``)."""
    found = self.backend.token_to_id(token)
    if found is None:
      raise TokenizerError(f"token {token!r} is not in the vocabulary of this tokenizer.json")
    return found

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Ids of ``text``; ``add_special_tokens`` runs the post-processor (e.g. Llama 3's bos)."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """Text of ``ids`` without pad; partial UTF-8 becomes U+FFFD (the byte-level decoders of
    ``tokenizers`` are lossy), so any ids in range decode."""
    kept = [i for i in _check_ids(ids, self.vocab_size) if i != self.pad_id]
    return self.backend.decode(kept, skip_special_tokens=skip_special_tokens)

  def chat_template(self) -> str:
    """The template source in use: ``chat_template_name``, else 'default' (transformers' rule)."""
    if not self.chat_templates:
      raise TokenizerError(
        "this tokenizer has no chat template (none in tokenizer_config.json 'chat_template' nor "
        "chat_template.jinja); add one or render prompts without apply_chat_template"
      )
    name = self.chat_template_name or "default"
    if name not in self.chat_templates:
      raise TokenizerError(
        f"chat template {name!r} not found; available: {sorted(self.chat_templates)} (pass "
        "chat_template_name)"
      )
    return self.chat_templates[name]

  def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
    """Renders like transformers: ``messages``, ``add_generation_prompt``, ``tools=None``,
    ``documents=None`` and the defined special tokens (``bos_token``, ``eos_token``, ...)."""
    template = compile_chat_template(self.chat_template())
    return template.render(
      messages=[dict(m) for m in messages],
      tools=None,
      documents=None,
      add_generation_prompt=add_generation_prompt,
      **self.template_tokens,
    )

  def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> list[int]:
    """Ids of the rendered chat; like transformers, no special tokens are added on top (the
    template writes bos itself where the model wants one)."""
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return self.encode(text)


def make_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
  """The tokenizer ``cfg`` names: the built-in ``CharTokenizer`` or ``HFTokenizer`` at cfg.path."""
  if cfg.kind == TokenizerKind.CHAR:
    return CharTokenizer()
  if cfg.kind == TokenizerKind.HF:
    return HFTokenizer.from_pretrained(cfg.path)
  raise TokenizerError(f"tokenizer kind {cfg.kind!r}; allowed: {[k.value for k in TokenizerKind]}")
