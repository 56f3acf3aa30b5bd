"""Prompt formats of the multi-turn rollout: environment text in, token ids appended to the context.

Data flow: ``rl/rollout.py`` asks a format for the ids of the first prompt (system instructions +
first observation + the assistant header) and, after each model turn, for the ids that close that
turn and open the next (the environment's answer + the assistant header). Environment and template
text is tokenised here exactly once; the model's own tokens are never decoded and re-encoded, so the
ids trained on are the ids sampled.

``PlainFormat`` is the compact format of the built-in character tokenizer (``<sys>...<end>``);
``ChatTemplateFormat`` renders a Hugging Face chat template and takes, for each later turn, the text
the template puts after an assistant message (computed with a placeholder message, so any template
works without knowing its markup).
"""

from __future__ import annotations

from collections.abc import Sequence

from earl_jax.model.tokenizer import CharTokenizer, Tokenizer


class PlainFormat:
  """``<bos><sys>{rules}<end><usr>{obs}<end><asst>`` then ``<usr>{obs}<end><asst>`` per turn."""

  def __init__(self, tokenizer: CharTokenizer):
    self.tokenizer = tokenizer
    self._usr = tokenizer.token_id("<usr>")
    self._asst = tokenizer.token_id("<asst>")
    self._end = tokenizer.end_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self.tokenizer.stop_ids

  def first(self, system: str, observation: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": observation}]
    return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

  def next(self, observation: str, stopped: bool) -> list[int]:
    # A turn cut by max_new_tokens gets its <end> here, so every turn is closed in the context.
    close = [] if stopped else [self._end]
    return [*close, self._usr, *self.tokenizer.encode(observation), self._end, self._asst]

  def action_text(self, ids: Sequence[int]) -> str:
    return _action_text(self.tokenizer, ids, self.stop_ids)


def for_tokenizer(tokenizer: Tokenizer) -> PlainFormat | ChatTemplateFormat:
  """The format a policy with ``tokenizer`` is trained (and played) with."""
  if isinstance(tokenizer, CharTokenizer):
    return PlainFormat(tokenizer)
  return ChatTemplateFormat(tokenizer)


def _action_text(tokenizer: Tokenizer, ids: Sequence[int], stop_ids: Sequence[int]) -> str:
  """The text the environment sees. Ids past the tokenizer's vocabulary (a checkpoint's embedding
  table is often larger, e.g. Qwen2.5's 151936 rows for 151665 tokens) carry no text."""
  keep = [i for i in ids if i not in stop_ids and 0 <= i < tokenizer.vocab_size]
  return tokenizer.decode(keep, skip_special_tokens=True)


_PLACEHOLDER = "\x00EARL_ASSISTANT_TURN\x00"


class ChatTemplateFormat:
  """Turns rendered by a tokenizer's chat template (Qwen2.5, Llama 3, ...)."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer
    probe = [
      {"role": "user", "content": "x"},
      {"role": "assistant", "content": _PLACEHOLDER},
      {"role": "user", "content": "\x00OBS\x00"},
    ]
    text = tokenizer.apply_chat_template(probe, add_generation_prompt=True)
    if _PLACEHOLDER not in text or "\x00OBS\x00" not in text:
      raise ValueError("the chat template drops message contents; cannot derive turn boundaries")
    after = text.split(_PLACEHOLDER, 1)[1]
    # e.g. Qwen: "<|im_end|>\n<|im_start|>user\n" + obs + "<|im_end|>\n<|im_start|>assistant\n"
    self._close_and_open, self._after_obs = after.split("\x00OBS\x00", 1)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self.tokenizer.stop_ids

  def first(self, system: str, observation: str) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": observation})
    return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

  def next(self, observation: str, stopped: bool) -> list[int]:
    head = self._close_and_open
    if stopped:
      # The model already emitted the end-of-turn token (e.g. <|im_end|>): drop its text here.
      for stop in self.stop_ids:
        stop_text = self.tokenizer.decode([stop])
        if stop_text and head.startswith(stop_text):
          head = head[len(stop_text) :]
          break
    return self.tokenizer.encode(head + observation + self._after_obs)

  def action_text(self, ids: Sequence[int]) -> str:
    return _action_text(self.tokenizer, ids, self.stop_ids)
