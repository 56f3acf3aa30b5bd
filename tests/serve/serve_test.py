"""Serving through JetStream: the Engine API decodes what the rollout engine decodes; the gRPC
server returns the same text, rejects malformed requests and keeps serving; a trained workdir
serves its policy."""

from __future__ import annotations

import re

import grpc
import jax
import numpy as np
import pytest
from flax import nnx

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel.plan import ShardingError, make_stage_plan
from earl_jax.sampler import engine as turn_engine
from earl_jax.serve import engine as serve_engine
from earl_jax.serve import server as serve_server
from earl_jax.types import Stage
from tests.sampler.slots_test import chunk

CFG = ModelConfig(
  vocab_size=105, embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
)  # fmt: skip
TOK = model_lib.CharTokenizer()
PROMPTS = [f"<bos><usr>{t}<end><asst>" for t in ("x 3", "o -", "hello there")]
MAX_NEW = 12


@pytest.fixture(scope="module")
def engine():
  graphdef, params = nnx.split(model_lib.Decoder(CFG, rngs=nnx.Rngs(3)))
  config = serve_engine.EngineConfig(num_slots=2, max_prefill_length=32, max_decode_length=24)
  return serve_engine.Engine(graphdef, params, CFG, TOK, config)


def _turn_engine_replies(engine, prompts: list[str]) -> list[list[int]]:
  """The rollout's (turn-synchronous) engine, greedy, on the same prompts: reply ids, stop
  token excluded (JetStream does not return it)."""
  ids = [TOK.encode(p) for p in prompts]
  tokens, mask, positions = chunk(ids, [0] * len(ids), 8, TOK.pad_id)
  spec = turn_engine.GenerationSpec.with_stop_ids(
    TOK.stop_ids, max_new_tokens=MAX_NEW, pad_id=TOK.pad_id
  )
  fn = turn_engine.make_generate_fn(engine.programs.graphdef, spec)
  cache = model_lib.init_cache(CFG, tokens.shape[0], 64)
  active = np.arange(tokens.shape[0]) < len(ids)
  out, _ = jax.device_get(
    fn(engine.load_params(), cache, tokens, mask, positions, active, jax.random.key(0))
  )
  replies = []
  for i in range(len(ids)):
    row = [int(t) for t in out.tokens_BxN[i, : int(out.lengths_B[i])]]
    replies.append([t for t in row if t not in TOK.stop_ids])
  return replies


def _engine_api_replies(engine, prompts: list[str]) -> list[list[int]]:
  """The Engine API driven as JetStream's orchestrator drives it (``Engine.decode_all``): more
  requests than slots, one token per generate call."""
  return engine.decode_all(prompts, MAX_NEW)


def test_engine_api_greedy_equals_the_rollout_engines_greedy(engine):
  want = _turn_engine_replies(engine, PROMPTS)
  assert _engine_api_replies(engine, PROMPTS) == want
  assert any(want)  # the random model says something


def test_an_engine_on_a_plan_serves_the_same_greedy_replies(engine):
  """Parameters and decode slots laid out on (data 2, tensor 2): slots over data, KV heads and
  projections over tensor; every array stays on the plan's four devices."""
  plan = make_stage_plan(Stage.ROLLOUT, range(4), data=2, tensor=2)
  graphdef, params = engine.programs.graphdef, engine.load_params()
  sharded = serve_engine.Engine(graphdef, params, CFG, TOK, engine.config, plan=plan)
  assert _engine_api_replies(sharded, PROMPTS) == _engine_api_replies(engine, PROMPTS)
  state = sharded.init_decode_state()
  assert state.cache.k.sharding.spec[1:3] == ("data", "tensor")
  assert {d.id for d in state.pos_B.sharding.device_set} == {0, 1, 2, 3}
  odd = serve_engine.EngineConfig(num_slots=3, max_prefill_length=32, max_decode_length=8)
  with pytest.raises(ShardingError, match="does not divide"):
    serve_engine.Engine(graphdef, params, CFG, TOK, odd, plan=plan)


def test_replies_end_at_max_decode_length(engine):
  replies = engine.decode_all(PROMPTS, 1000)
  assert max(len(r) for r in replies) == engine.config.max_decode_length  # 24


def test_prefill_checks_its_length(engine):
  with pytest.raises(ValueError, match="true_length=0"):
    engine.prefill(params=engine.load_params(), padded_tokens=np.zeros(16, np.int32), true_length=0)
  with pytest.raises(ValueError, match="prompt 0 has 40 tokens; this engine prefills at most 32"):
    engine.decode_all(["x" * 40], 4)
  with pytest.raises(ValueError, match="max_prefill_length=100"):
    serve_engine.EngineConfig(max_prefill_length=100)


@pytest.fixture(scope="module")
def server(engine):
  with serve_server.Server(engine, port=0) as s:
    yield s


def test_grpc_decode_returns_the_engines_text_and_ids(server, engine):
  want = _turn_engine_replies(engine, PROMPTS)
  for prompt, ids in zip(PROMPTS, want):
    text, got = serve_server.decode(server.address, text=prompt, max_tokens=MAX_NEW)
    assert got == ids
    assert text == TOK.decode(ids)
  # Token content in, token ids out: the same reply.
  _, got = serve_server.decode(server.address, token_ids=TOK.encode(PROMPTS[0]), max_tokens=MAX_NEW)
  assert got == want[0]
  assert serve_server.health(server.address)


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"text": ""}, "no content|text_content.text is empty"),
    ({"token_ids": [5, 999, -1]}, r"token ids \[999, -1\] are outside"),
    ({"text": "x" * 40}, "the prompt has 40 tokens; this server prefills at most 32"),
    ({"text": "<bos>", "max_tokens": 0}, "max_tokens=0"),
  ],
)
def test_malformed_requests_get_invalid_argument_and_the_server_keeps_serving(
  server, engine, kwargs, message
):
  kwargs.setdefault("max_tokens", 4)
  with pytest.raises(grpc.RpcError) as e:
    serve_server.decode(server.address, **kwargs)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert re.search(message, e.value.details())
  _, got = serve_server.decode(server.address, text=PROMPTS[1], max_tokens=MAX_NEW)
  assert got == _turn_engine_replies(engine, PROMPTS[1:2])[0]


def test_a_pretrained_checkpoint_serves_what_transformers_generates(tmp_path):
  """Engine.from_pretrained on a tiny local Qwen2 checkpoint (its tokenizer and chat template):
  greedy replies equal transformers' greedy generate."""
  import torch
  import transformers

  from tests.colab_test import _tiny_qwen_checkpoint

  directory = _tiny_qwen_checkpoint(tmp_path / "qwen")
  config = serve_engine.EngineConfig(num_slots=2, max_prefill_length=64, max_decode_length=10)
  eng = serve_engine.Engine.from_pretrained(directory, config)
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  stops = list(eng.tokenizer.stop_ids)
  for text in ("You play column 3.", "Connect Four"):
    messages = [{"role": "user", "content": text}]
    ids = eng.tokenizer.encode_chat(messages, add_generation_prompt=True)
    with torch.no_grad():
      out = hf.generate(
        torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=stops,
        pad_token_id=eng.tokenizer.pad_id,
      )  # fmt: skip
    want = [t for t in out[0, len(ids) :].tolist() if t not in stops]
    prompt = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    (got,) = eng.decode_all([prompt], 10)  # the text encodes to ``ids`` (encode_chat's definition)
    assert got == want, text


def test_a_second_server_on_a_port_in_use_fails_clearly(server, engine):
  with pytest.raises(OSError, match=f"could not bind localhost:{server.port}"):
    serve_server.Server(engine, port=server.port)
  assert serve_server.health(server.address)  # the first one still serves
