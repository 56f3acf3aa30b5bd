"""Turn formats: appending turns id by id reproduces the chat template of the whole conversation."""

from earl_jax.model.tokenizer import CharTokenizer, HFTokenizer
from earl_jax.rl import turn_format
from tests.model.tokenizer_test import backend, hf_dir  # noqa: F401  (pytest fixtures)

SYSTEM, OBS1, ACT, OBS2 = (
  "Rules: answer <move>N</move>.",
  "board one",
  "<move>3</move>",
  "board two",
)


def _conversation(gen: bool) -> list[dict[str, str]]:
  return [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": OBS1},
    {"role": "assistant", "content": ACT},
    {"role": "user", "content": OBS2},
  ]


def test_chat_template_turns_match_rendering_the_whole_conversation(hf_dir):  # noqa: F811
  tok = HFTokenizer.from_pretrained(hf_dir)
  fmt = turn_format.ChatTemplateFormat(tok)
  first = fmt.first(SYSTEM, OBS1)
  assert first == tok.encode_chat(_conversation(True)[:2], add_generation_prompt=True)
  im_end = tok.token_id("<|im_end|>")
  # The model's turn as sampled: its ids, ending with the stop token (never re-encoded here).
  sampled = [*tok.encode(ACT), im_end]
  ids = first + sampled + fmt.next(OBS2, stopped=True)
  want = tok.apply_chat_template(_conversation(True), add_generation_prompt=True)
  assert tok.decode(ids) == want
  assert fmt.action_text(sampled) == ACT
  # A turn cut by max_new_tokens (no stop token) is closed by the format instead.
  cut = first + tok.encode(ACT) + fmt.next(OBS2, stopped=False)
  assert tok.decode(cut) == want


def test_plain_format_turns_match_the_char_chat_format():
  tok = CharTokenizer()
  fmt = turn_format.PlainFormat(tok)
  sampled = [*tok.encode(ACT), tok.end_id]
  ids = fmt.first(SYSTEM, OBS1) + sampled + fmt.next(OBS2, stopped=True)
  assert ids == tok.encode_chat(_conversation(True), add_generation_prompt=True)
  cut = fmt.first(SYSTEM, OBS1) + tok.encode(ACT) + fmt.next(OBS2, stopped=False)
  assert cut == ids[: len(cut)] and len(cut) == len(ids)
  assert fmt.action_text(sampled) == ACT


def test_action_text_drops_ids_past_the_tokenizer_vocabulary(hf_dir):  # noqa: F811
  tok = HFTokenizer.from_pretrained(hf_dir)
  fmt = turn_format.ChatTemplateFormat(tok)
  # A checkpoint's embedding table can be larger than the tokenizer (Qwen2.5: 151936 vs 151665).
  assert fmt.action_text([*tok.encode("3"), tok.vocab_size, tok.vocab_size + 5]) == "3"
