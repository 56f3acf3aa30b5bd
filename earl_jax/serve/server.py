"""JetStream's orchestrator and gRPC ``Orchestrator`` service around an earl_jax ``Engine``.

Data flow: a gRPC ``Decode`` request (text or token ids) is checked here first (empty, over-long
or out-of-vocabulary content and a non-positive ``max_tokens`` get INVALID_ARGUMENT, and the server
keeps serving: JetStream's driver threads kill the process on any exception, so nothing malformed
may reach them), then JetStream's ``Driver`` prefills it, inserts it into a free decode slot and
streams its tokens back while other requests decode in the same batch (continuous batching).
``HealthCheck`` is JetStream's.

The server prefills exactly the request's tokens (no BOS is added): a client sends the prompt in
the format the policy was trained on (``launch/play.py`` builds it with the run's turn format).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import grpc
import numpy as np
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
from jetstream.engine import token_utils

from earl_jax.serve.engine import Engine
from earl_jax.serve.jetstream_compat import orchestrator


class _Driver(orchestrator.Driver):
  """JetStream's driver, prefilling each request's tokens as they are (no BOS prepended)."""

  def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
    del is_bos
    content = request.prefill_content
    if isinstance(content, str):
      return tokenizer.encode(
        content, max_prefill_length=max_prefill_length, jax_padding=self._jax_padding
      )
    return token_utils.pad_tokens(
      np.asarray(content, np.int32),
      tokenizer.bos_id,
      tokenizer.pad_id,
      is_bos=False,
      max_prefill_length=max_prefill_length,
      jax_padding=self._jax_padding,
    )


def request_error(request: jetstream_pb2.DecodeRequest, engine: Engine) -> str | None:
  """Why ``request`` cannot be served (None: it can)."""
  which = request.WhichOneof("content")
  if which is None:
    return "the request has no content: set text_content or token_content"
  if request.max_tokens < 1:
    return f"max_tokens={request.max_tokens}; ask for at least 1 token"
  if which == "text_content":
    if not request.text_content.text:
      return "text_content.text is empty"
    ids = engine.tokenizer.encode(request.text_content.text)
  else:
    ids = list(request.token_content.token_ids)
    if not ids:
      return "token_content.token_ids is empty"
    bad = [i for i in ids if not 0 <= i < engine.model_cfg.vocab_size]
    if bad:
      return f"token ids {bad[:8]} are outside the vocabulary [0, {engine.model_cfg.vocab_size})"
  limit = engine.max_prefill_length
  if len(ids) > limit:
    return f"the prompt has {len(ids)} tokens; this server prefills at most {limit}"
  return None


class Orchestrator(orchestrator.LLMOrchestrator):
  """JetStream's gRPC servicer with requests checked before they reach the driver."""

  def __init__(self, driver: orchestrator.Driver, engine: Engine):
    super().__init__(driver=driver)
    self._engine = engine

  async def Decode(self, request, context=None):
    error = request_error(request, self._engine)
    if error is not None:
      if context is None:
        raise ValueError(error)
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
      return
    async for response in super().Decode(request, context):
      yield response


class Server:
  """A running server: JetStream's driver threads and a gRPC server on ``port`` (0: any free one,
  then ``self.port`` says which)."""

  def __init__(self, engine: Engine, port: int = 0, host: str = "localhost", threads: int = 0):
    params = engine.load_params()
    self.driver = _Driver(
      prefill_engines=[engine],
      generate_engines=[engine],
      prefill_params=[params],
      generate_params=[params],
      interleaved_mode=True,
    )
    threads = threads or max(engine.max_concurrent_decodes * 2, 16)
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
    self._loop = asyncio.new_event_loop()
    self._loop.set_default_executor(self._executor)
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
    self._thread.start()
    self._grpc = self._run(self._make_server())
    jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
      Orchestrator(self.driver, engine), self._grpc
    )
    try:
      self.port = self._grpc.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio >= 1.60 raises where older versions returned 0
      self.port = 0
    if self.port == 0:
      self.stop()
      raise OSError(f"could not bind {host}:{port}: is another server using that port?")
    self.address = f"{host}:{self.port}"
    self._run(self._grpc.start())

  async def _make_server(self):
    # No SO_REUSEPORT: a second server on a port in use must fail, not share the port.
    return grpc.aio.server(self._executor, options=[("grpc.so_reuseport", 0)])

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

  def wait(self) -> None:
    """Blocks until the server stops (Ctrl-C stops it)."""
    self._run(self._grpc.wait_for_termination())

  def stop(self) -> None:
    self.driver.stop()
    if hasattr(self, "_grpc"):
      self._run(self._grpc.stop(grace=1))
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join()
    self._executor.shutdown(wait=False)

  def __enter__(self) -> Server:
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def decode(address: str, *, text: str = "", token_ids=(), max_tokens: int = 32, timeout=60.0):
  """A client call: the whole reply of one ``Decode`` request as (text, token ids)."""
  with grpc.insecure_channel(address) as channel:
    stub = jetstream_pb2_grpc.OrchestratorStub(channel)
    if token_ids:
      content = {"token_content": jetstream_pb2.DecodeRequest.TokenContent(token_ids=token_ids)}
    else:
      content = {"text_content": jetstream_pb2.DecodeRequest.TextContent(text=text)}
    request = jetstream_pb2.DecodeRequest(max_tokens=max_tokens, **content)
    pieces, ids = [], []
    for response in stub.Decode(request, timeout=timeout):
      for sample in response.stream_content.samples:
        pieces.append(sample.text)
        ids.extend(sample.token_ids)
    return "".join(pieces), ids


def health(address: str, timeout: float = 10.0) -> bool:
  with grpc.insecure_channel(address) as channel:
    stub = jetstream_pb2_grpc.OrchestratorStub(channel)
    return stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=timeout).is_live
