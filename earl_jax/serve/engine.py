"""earl_jax's policy behind JetStream's ``Engine`` API (prefill / insert / generate over slots).

Data flow: JetStream's orchestrator (``serve/server.py``) tokenises a request, calls ``prefill``
(one request, padded to a bucket), ``insert`` (the prefix into a free decode slot) and, in a loop,
``generate`` (one token for every slot), and detokenises what comes back. The three calls are the
jitted functions of ``earl_jax/sampler/slots.py``, the same ones the continuous-batching rollout
runs, so a served policy decodes exactly as it did in training (same sampling strategies, same
KV cache, the run's parameters).

Build one with ``Engine.from_workdir`` (the newest checkpoint of a training run) or
``Engine.from_pretrained`` (a Hugging Face checkpoint directory). Requires the ``serve`` extra
(``pip install -e ".[serve]"``): JetStream pulls seqio and tensorflow, which the training install
does not need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import executables
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel import plan as plan_lib
from earl_jax.parallel.plan import StagePlan
from earl_jax.sampler import engine as engine_lib
from earl_jax.sampler import sampling, slots
from earl_jax.types import BATCH

# JetStream pads prefills to these lengths (``token_utils.pad_tokens``); max_prefill_length must
# be one of them.
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int = 8  # concurrent decodes (JetStream's max_concurrent_decodes)
  max_prefill_length: int = 256  # longest prompt, in tokens; one of PREFILL_LENGTHS
  max_decode_length: int = 256  # cache slots after the prompt: the longest reply
  strategy: Any = dataclasses.field(default_factory=sampling.Greedy)

  def __post_init__(self):
    if self.max_prefill_length not in PREFILL_LENGTHS:
      raise ValueError(f"max_prefill_length={self.max_prefill_length}; allowed: {PREFILL_LENGTHS}")
    for key in ("num_slots", "max_decode_length"):
      if getattr(self, key) < 1:
        raise ValueError(f"{key}={getattr(self, key)}; a positive int")

  @property
  def cache_len(self) -> int:
    return self.max_prefill_length + self.max_decode_length


class TokenizerAdapter(tokenizer_api.Tokenizer):
  """An earl_jax tokenizer as JetStream's: text in and out; no BOS is added (requests carry the
  exact prompt, e.g. the chat format the policy was trained on); the policy's stop ids end a
  reply."""

  def __init__(self, tokenizer: model_lib.Tokenizer):
    self.tokenizer = tokenizer

  def encode(self, s: str, **kwargs) -> tuple[jax.Array | np.ndarray, int]:
    ids = np.asarray(self.tokenizer.encode(s), np.int32)
    return token_utils.pad_tokens(
      ids,
      self.bos_id,
      self.pad_id,
      is_bos=False,
      max_prefill_length=kwargs.get("max_prefill_length"),
      jax_padding=kwargs.get("jax_padding", True),
    )

  def decode(self, token_ids: list[int], **kwargs) -> str:
    del kwargs
    ids = [int(i) for i in token_ids if 0 <= int(i) < self.tokenizer.vocab_size]
    return self.tokenizer.decode(ids)

  @property
  def pad_id(self) -> int:
    return self.tokenizer.pad_id

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def bos_id(self) -> int:
    bos = self.tokenizer.bos_id
    return self.tokenizer.pad_id if bos is None else bos

  @property
  def stop_tokens(self) -> set[int]:
    return set(self.tokenizer.stop_ids)


class Engine(engine_api.Engine):
  """JetStream's Engine over an earl_jax Decoder: ``params`` is its nnx parameter state."""

  def __init__(
    self,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    model_cfg: ModelConfig,
    tokenizer: model_lib.Tokenizer,
    config: EngineConfig | None = None,
    *,
    plan: StagePlan | None = None,
    description: str = "",
  ):
    """``plan``: the layout to serve on (parameters and decode slots sharded as a rollout plan
    shards them; slots over its batch axes); None: the first device."""
    self.config = config or EngineConfig()
    self.model_cfg, self.tokenizer, self.description = model_cfg, tokenizer, description
    self.plan = plan
    if plan is None:
      self._params = params
      self._mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    else:
      plan_lib.validate_for_model(plan, model_cfg, self.config.num_slots)
      self._params = jax.device_put(params, mesh_lib.state_shardings(params, plan))
      self._mesh = mesh_lib.build_mesh(plan)
    self.spec = engine_lib.GenerationSpec.with_stop_ids(
      tuple(tokenizer.stop_ids),
      strategy=self.config.strategy,
      max_new_tokens=self.config.max_decode_length,
      pad_id=tokenizer.pad_id,
    )
    self.programs = slots.SlotPrograms(graphdef, self.spec, steps=1)
    self._seed = 0

  # --- construction -------------------------------------------------------------------------

  @classmethod
  def from_workdir(
    cls, workdir: str, config: EngineConfig | None = None, *, step=None, plan=None
  ) -> Engine:
    """The policy of a training run's checkpoint ``step`` (default: the newest)."""
    from earl_jax import export  # the checkpoint reader (a --pretrained server does without)

    policy = export.load_policy(workdir, step=step, plan=plan)
    graphdef, _ = nnx.split(
      nnx.eval_shape(lambda: model_lib.Decoder(policy.model_cfg, rngs=nnx.Rngs(0)))
    )
    tokenizer = model_lib.make_tokenizer(policy.config.tokenizer)
    what = f"{workdir} step {policy.step}"
    return cls(
      graphdef, policy.params, policy.model_cfg, tokenizer, config, plan=plan, description=what
    )

  @classmethod
  def from_pretrained(cls, path: str, config: EngineConfig | None = None, *, plan=None) -> Engine:
    """A Hugging Face checkpoint directory (config.json, safetensors, tokenizer files); with a
    plan, each device reads only its block of every tensor."""
    from earl_jax.model import hf_import

    model_cfg, ckpt_dir = hf_import.read_config(path)
    shardings = None
    if plan is not None:
      abstract = nnx.eval_shape(lambda: model_lib.Decoder(model_cfg, rngs=nnx.Rngs(0)))
      shardings = mesh_lib.state_shardings(nnx.state(abstract), plan)
    graphdef, params = nnx.split(hf_import.load_weights(ckpt_dir, model_cfg, shardings))
    tokenizer = model_lib.HFTokenizer.from_pretrained(ckpt_dir)
    return cls(graphdef, params, model_cfg, tokenizer, config, plan=plan, description=ckpt_dir)

  def decode_all(self, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Each prompt's reply ids (the stop token excluded, at most ``max_tokens``), with the Engine
    API driven as JetStream's orchestrator drives it, in one thread and without gRPC: a free slot
    takes the next prompt (prefill, insert) and each ``generate`` call decodes a token for every
    slot. For tests and the direct-call serving benchmark."""
    tok = self.build_tokenizer(self.get_tokenizer())
    params, state = self.load_params(), self.init_decode_state()
    queue, owner = list(range(len(prompts))), {}
    replies: list[list[int]] = [[] for _ in prompts]
    while queue or owner:
      for slot in range(self.max_concurrent_decodes):
        if slot not in owner and queue:
          i = queue.pop(0)
          padded, n = tok.encode(prompts[i], max_prefill_length=self.max_prefill_length)
          if n > self.max_prefill_length:
            raise ValueError(
              f"prompt {i} has {n} tokens; this engine prefills at most {self.max_prefill_length}"
            )
          prefix = self.prefill(params=params, padded_tokens=padded, true_length=n)
          state = self.insert(prefix, state, slot)
          owner[slot] = i
      state, result = self.generate(params, state)
      result = result.convert_to_numpy()
      for slot, i in list(owner.items()):
        data = result.get_result_at_slot(slot)
        t = int(data.tokens[0, 0])
        if not data.valid[0, 0] or t in tok.stop_tokens or len(replies[i]) >= max_tokens:
          del owner[slot]
        else:
          replies[i].append(t)
    return replies

  # --- the Engine API -----------------------------------------------------------------------

  def prefill(
    self,
    *,
    params: Any,
    existing_prefix: slots.Prefix | None = None,
    padded_tokens: jax.Array,
    true_length: int,
  ) -> slots.Prefix:
    """One request's prompt (``padded_tokens[:true_length]``) after ``existing_prefix``."""
    p = int(padded_tokens.shape[-1])
    if not 0 < true_length <= p:
      raise ValueError(f"true_length={true_length}; a prompt needs 1..{p} tokens")
    if existing_prefix is None:
      existing = self._laid_out(model_lib.init_cache(self.model_cfg, 1, self.config.cache_len))
      start = 0
    else:
      existing, start = existing_prefix.cache, int(existing_prefix.pos_R[0])
    mask = (np.arange(p) < true_length)[None]
    positions = (start + np.arange(p, dtype=np.int32))[None] * mask
    tokens = jnp.asarray(padded_tokens, jnp.int32).reshape(1, p)
    return self.programs.prefill(params, existing, tokens, mask, positions.astype(np.int32))

  def insert(self, prefix: slots.Prefix, decode_state: slots.SlotState, slot: int):
    # Replies end at max_decode_length tokens, or earlier where a long existing prefix fills the
    # cache row (generate ends a turn on a full row).
    budget = np.asarray([self.config.max_decode_length], np.int32)
    return self.programs.insert(prefix, decode_state, np.asarray([slot], np.int32), budget)

  def generate(self, params: Any, decode_state: slots.SlotState):
    state, out = self.programs.generate(params, decode_state)
    data = jnp.concatenate(
      [out.tokens_BxN, out.valid_BxN.astype(jnp.int32), state.count_B[:, None]], axis=1
    )
    return state, engine_api.ResultTokens(
      data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
    )

  def load_params(self, *args, **kwargs) -> nnx.State:
    del args, kwargs
    return self._params

  def get_prefix_destination_sharding(self) -> Any:
    return None  # prefill and generate share the devices (interleaved mode)

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path=self.description)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenizerAdapter:
    del metadata
    return TokenizerAdapter(self.tokenizer)

  def init_decode_state(self, *args, **kwargs) -> slots.SlotState:
    del args, kwargs
    self._seed += 1
    cache = model_lib.init_cache(self.model_cfg, self.config.num_slots, self.config.cache_len)
    state = self.programs.new_state(
      cache, self.model_cfg.padded_vocab_size, jax.random.key(self._seed)
    )
    return self._laid_out(state)

  def _laid_out(self, tree: Any) -> Any:
    """A decode state or a one-row prefix cache on the plan: rows over the batch axes when
    there are as many as the decode slots, else replicated; KV heads over the tensor axes."""
    if self.plan is None:
      return tree
    plan, rows = self.plan, self.config.num_slots
    axes = {model_lib.KVCache: model_lib.cache_partition_specs()}

    def sharding(spec, x):
      spec = tuple(spec)
      if x.ndim and x.shape[0] != rows and spec and spec[0] == BATCH:
        spec = (None, *spec[1:])
      if len(spec) > 1 and spec[1] == BATCH and x.shape[1] != rows:
        spec = (spec[0], None, *spec[2:])
      return mesh_lib.logical_to_sharding(spec, x.shape, plan)

    cache = tree.cache if isinstance(tree, slots.SlotState) else tree
    laid = jax.device_put(cache, jax.tree.map(sharding, axes[model_lib.KVCache], cache,
                                              is_leaf=lambda s: isinstance(s, P)))  # fmt: skip
    if not isinstance(tree, slots.SlotState):
      return laid
    names = ("logits_BxV", "pos_B", "live_B", "count_B", "budget_B", "stopped_B", "hist_BxM")
    rest = {
      k: jax.device_put(getattr(tree, k), sharding((BATCH,), getattr(tree, k))) for k in names
    }
    return tree.replace(cache=laid, rng=jax.device_put(tree.rng, executables.replicated(plan)),
                        **rest)  # fmt: skip

  @property
  def max_concurrent_decodes(self) -> int:
    return self.config.num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self.config.max_prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None
