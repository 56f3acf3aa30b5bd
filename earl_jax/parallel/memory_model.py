"""Analytic per-device memory and step-time model of the three stage programs.

Data flow: the selector calls ``estimate_memory`` for every candidate StagePlan of a stage and
bucket to discard plans that cannot fit (before anything is compiled), and ``estimate_seconds``
to rank the rest when no profiling table exists. The compiled program's ``memory_analysis`` is
the final word (``parallel/executables.py``); this model only has to be close (the tests pin it
to the compiled figures within ``MEMORY_TOLERANCE``) and fast enough to plan a 72B model on a
128-device pool without touching a device.

Memory terms (per device, bytes), following what the programs keep alive at their peak:
  weights     every parameter tensor / the product of the shards of its logical axes (rollout:
              the blocks once more where the decode loop runs per-layer copies, CPU)
  optimizer   Adam's two moments, shaped and sharded like the parameters (update only)
  gradients   one gradient tree, plus the accumulator when there are several micro-batches
  kv_cache    rollout: [L, slots, S, K, Dh] keys + values, plus ``DeviceSpec.kv_cache_copies``
              extra copies (XLA:CPU double-buffers the cache carried through the decode loop)
  activations one layer's attention temporaries (``model.attention`` as the platform resolves
              ``auto``, see ``attention.resolve``: naive keeps f32 [B, H, T, S] scores ~3 times,
              and without remat every layer's probabilities for the backward pass, without a
              cache only its causal query blocks' share of them; the blockwise
              kernels keep [B, H, Bq, Bk] score blocks, key/value block copies and O(T)
              accumulators, and in the backward pass f32 dq/dk/dv), MLP intermediates, and for
              the update the per-layer residuals saved for the backward pass (all of them, or
              one per layer under remat)
  logits      one [B, C, V] f32 chunk (reference/update) or [B, V] (decode), ~3 live copies
  io          tokens, masks and outputs of the program

Step-time model (``estimate_seconds``): each device runs max(flops / peak_flops, bytes / hbm_bw)
plus two all-reduces per layer over the tensor axis (latency ``allreduce_latency_s`` per hop,
growing with the tensor size, plus bytes / link bandwidth), plus for the update an FSDP gather of
the weights and a reduce-scatter of the gradients. Decode at small batch is thus bound by reading
the weights (which shrink with the tensor size), at large batch and context by the KV cache and
compute, and a larger tensor axis pays more all-reduce latency.
"""

from __future__ import annotations

import dataclasses
import math

from earl_jax.model import attention
from earl_jax.model.config import ModelConfig
from earl_jax.parallel.plan import StagePlan
from earl_jax.types import (
  BATCH,
  EMBED,
  HEAD_DIM,
  HEADS,
  KV_HEADS,
  MLP,
  NORM,
  TENSOR,
  VOCAB,
  Stage,
)

# predicted / compiled peak stays in this range (memory_model_test.py): the model errs on the safe
# side (short sequences, where XLA fuses the attention temporaries, are over-predicted).
MEMORY_TOLERANCE = (0.9, 1.75)
_SCORE_COPIES = 3  # scores, masked scores, softmax probabilities (f32), see module docstring
# Live score-sized f32 buffers in one layer's naive attention backward, fitted to XLA:CPU's
# compiled peaks (T 256 and 512, 2 and 4 layers, remat none and full): ~6 in a scan, ~3 with the
# layers unrolled (model.forward_layers; no stacked residual buffers beside them), ~2 when the
# layer is rematerialised (always scanned). Without remat each layer's saved probabilities come
# on top, see _scored. Fitted before the softmax's own derivative rule (``attention.softmax``),
# whose backward pass holds fewer score-sized buffers at large B x T (the 31M update of 32 x 288
# tokens: 0.8 GiB less), so these err high there, on the safe side.
_BACKWARD_SCORE_COPIES = 6
_UNROLLED_BACKWARD_SCORE_COPIES = 3
_REMAT_BACKWARD_SCORE_COPIES = 2
_LOGIT_COPIES = 3  # logits, log-softmax, exp(log-softmax)
_REFERENCE_LOGIT_COPIES = 2  # forward only: the log-softmax fuses with the logits (measured)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Per-device speeds for the analytic step-time model (defaults: H100 SXM, NVLink)."""

  peak_flops: float = 989e12  # bf16 dense
  hbm_bytes_per_s: float = 3.35e12
  link_bytes_per_s: float = 450e9  # NVLink per direction
  allreduce_latency_s: float = 2e-6  # per ring hop; a tensor-size-t all-reduce pays (t-1) hops
  flops_efficiency: float = 0.5  # achieved / peak for large matmuls
  kv_cache_copies: int = 0  # extra cache buffers the decode loop holds (XLA:GPU updates in place)
  platform: str = "gpu"  # jax backend name: decides what model.decode_layers="auto" runs


CPU_SPEC = DeviceSpec(
  peak_flops=2e10,
  hbm_bytes_per_s=1e10,
  link_bytes_per_s=5e9,
  allreduce_latency_s=2e-5,
  kv_cache_copies=1,  # measured: XLA:CPU's temp holds one more cache
  platform="cpu",
)
DEFAULT_SPEC = DeviceSpec()


@dataclasses.dataclass(frozen=True)
class Workload:
  """The shape of one stage call, as the selector sees it.

  load: rollout: concurrent sequences (the engine's slots); reference/update: global batch.
  length: the length bucket: rollout: KV-cache slots per row; reference/update: tokens per row.
  prompt_chunk: rollout: tokens prefilled per generate call.
  new_tokens: rollout: decode steps per generate call.
  logits_chunk: reference/update: tokens per logits chunk.
  """

  stage: Stage
  load: int
  length: int
  prompt_chunk: int = 16
  new_tokens: int = 8
  logits_chunk: int = 128


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes by term (see module docstring)."""

  weights: int
  optimizer: int
  gradients: int
  kv_cache: int
  activations: int
  logits: int
  io: int

  @property
  def total(self) -> int:
    return sum(dataclasses.astuple(self))

  def to_dict(self) -> dict[str, int]:
    return {**dataclasses.asdict(self), "total": self.total}


def _layer_specs(cfg: ModelConfig) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
  """(shape, logical axes) of the parameters of one decoder block."""
  d, f, h, k, dh = cfg.embed_dim, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  layer = [
    ((d,), (NORM,)),
    ((d, h, dh), (EMBED, HEADS, HEAD_DIM)),
    ((d, k, dh), (EMBED, KV_HEADS, HEAD_DIM)),
    ((d, k, dh), (EMBED, KV_HEADS, HEAD_DIM)),
    ((h, dh, d), (HEADS, HEAD_DIM, EMBED)),
    ((d,), (NORM,)),
    ((d, f), (EMBED, MLP)),
    ((d, f), (EMBED, MLP)),
    ((f, d), (MLP, EMBED)),
  ]
  if cfg.qkv_bias:
    layer += [((h, dh), (HEADS, HEAD_DIM))] + [((k, dh), (KV_HEADS, HEAD_DIM))] * 2
  return layer


def param_specs(cfg: ModelConfig) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
  """(shape, logical axes) of every parameter of ``earl_jax.model.Decoder``."""
  d, vp = cfg.embed_dim, cfg.padded_vocab_size
  specs = [((vp, d), (VOCAB, EMBED)), ((d,), (NORM,))] + _layer_specs(cfg) * cfg.num_layers
  if not cfg.tie_embeddings:
    specs.append(((d, vp), (EMBED, VOCAB)))
  return specs


def param_elements_per_device(cfg: ModelConfig, plan: StagePlan, blocks_only: bool = False) -> int:
  """Parameter elements one device holds under ``plan`` (shards of every tensor's axes); with
  ``blocks_only`` those of the decoder blocks alone."""
  specs = _layer_specs(cfg) * cfg.num_layers if blocks_only else param_specs(cfg)
  total = 0
  for shape, names in specs:
    shards = math.prod(plan.shards_for(n) for n in names)
    total += math.prod(shape) // shards
  return total


def _dtype_bytes(name: str) -> int:
  return 2 if name == "bfloat16" else 4


def _attention_impl(cfg: ModelConfig, spec: DeviceSpec, seq_len: int, cached: bool) -> str:
  """The attention implementation the program runs on ``spec``'s platform (``auto`` resolved)."""
  return attention.resolve(
    cfg.attention,
    cached=cached,
    seq_len=seq_len,
    block_size=cfg.attention_block,
    backend=spec.platform,
  )


def _naive_score_fraction(queries: int, causal: bool, backward: bool) -> float:
  """The share of the [T, S] scores naive attention holds: its causal query blocks skip the
  keys past each block's last query (``attention.causal_blocks``). The backward pass keeps every
  block's probabilities; a forward pass alone about half the blocks' scores at once (fitted to
  XLA:CPU's compiled reference peaks at T 256 and 512 on four meshes: predicted/compiled
  0.9-1.2 with half, 0.55-0.8 with the largest block alone, 1.4-1.9 with all of them)."""
  if not causal:
    return 1.0
  share = attention.causal_score_fraction(queries, attention.QUERY_BLOCK)
  return share if backward else share / 2


def _attention_bytes(
  cfg: ModelConfig,
  impl: str,
  rows: int,
  queries: int,
  keys: int,
  tp_heads: int,
  copies: int = _SCORE_COPIES,
  backward: bool = False,
  remat: bool = False,
  unrolled: bool = False,
  causal: bool = False,
) -> int:
  """One layer's live attention temporaries under ``impl`` (see the module docstring);
  ``causal``: uncached, so naive computes only its causal query blocks' scores."""
  heads = cfg.num_heads // tp_heads
  if impl == "naive":
    if backward and remat:
      copies = _REMAT_BACKWARD_SCORE_COPIES
    elif backward:
      copies = _UNROLLED_BACKWARD_SCORE_COPIES if unrolled else _BACKWARD_SCORE_COPIES
    scores = rows * queries * keys * _naive_score_fraction(queries, causal, backward)
    return int(copies * heads * scores * 4 + scores)
  cb = _dtype_bytes(cfg.compute_dtype.value)
  kv, dh = max(1, cfg.num_kv_heads // tp_heads), cfg.head_dim
  bq, bk = min(cfg.attention_block, queries), min(cfg.attention_block, keys)
  scores = rows * heads * bq * bk * 4
  # Score blocks: scores, masked scores, probabilities and the block mask (measured ~4 live).
  fwd = (
    (copies + 1) * scores + 4 * rows * bk * kv * dh * cb + rows * queries * heads * dh * (cb + 8)
  )
  if not backward:
    return fwd
  # dq, dO and O in f32 [B, T, H, Dh]; dk, dv in f32 [B, S, K, Dh]; ~3 more score blocks.
  return fwd + 3 * scores + 3 * rows * queries * heads * dh * 4 + 2 * rows * keys * kv * dh * 4


def _rollout(cfg: ModelConfig, plan: StagePlan, w: Workload, spec: DeviceSpec) -> MemoryEstimate:
  copies = spec.kv_cache_copies
  cb = _dtype_bytes(cfg.compute_dtype.value)
  rows = max(1, w.load // plan.shards_for(BATCH))
  kv = cfg.num_kv_heads // plan.shards_for(KV_HEADS)
  cache = 2 * cfg.num_layers * rows * w.length * kv * cfg.head_dim * cb + rows * (w.length + 4)
  p = w.prompt_chunk
  tp = plan.shards_for(HEADS)
  mlp = 3 * rows * p * (cfg.mlp_dim // plan.shards_for(MLP)) * cb
  # The prefill chunk's scores fuse into one buffer (measured); the cache dominates anyway.
  act = (
    _attention_bytes(cfg, _attention_impl(cfg, spec, p, True), rows, p, w.length, tp, copies=1)
    + mlp
    + 4 * rows * p * cfg.embed_dim * cb
  )
  vocab = cfg.padded_vocab_size // plan.shards_for(VOCAB)
  logits = _LOGIT_COPIES * rows * vocab * 4
  io = rows * p * 9 + rows * w.new_tokens * 9 + rows * 16
  weights = param_elements_per_device(cfg, plan)
  if cfg.unrolled_decode(spec.platform):  # the decode loop's per-layer copy of the blocks
    weights += param_elements_per_device(cfg, plan, blocks_only=True)
  return MemoryEstimate(
    weights=weights * _dtype_bytes(cfg.param_dtype.value) + _head_cast_bytes(cfg, plan),
    optimizer=0,
    gradients=0,
    kv_cache=cache * (1 + copies),
    activations=act,
    logits=logits,
    io=io,
  )


def _head_cast_bytes(cfg: ModelConfig, plan: StagePlan) -> int:
  """The compute-dtype copy of the output projection that decoding reads every step, when the
  weights are stored in another dtype (float32 master weights, bf16 compute): hoisted out of the
  decode loop, it lives through it."""
  if cfg.param_dtype == cfg.compute_dtype:
    return 0
  cb = _dtype_bytes(cfg.compute_dtype.value)
  return cfg.padded_vocab_size * cfg.embed_dim * cb // plan.shards_for(VOCAB)


def _saved_bytes_per_token(cfg: ModelConfig, plan: StagePlan) -> int:
  """Bytes per token of one decoder layer's forward values that its backward pass reads.

  Fitted to XLA's compiled peaks for Qwen2.5-0.5B and 7B (bf16 compute, float32 weights, 1-2K
  tokens, tensor 1-4): ~12 float32 vectors of the residual stream (norm statistics and inputs),
  ~(8 cb + 40) bytes per query/output head element (projections, rotary embedding in float32,
  attention output and its statistics) and ~(3 cb + 8) per MLP element (gate, up, activation in
  float32, product). That fit predates the rematerialised MLP activation (``layers.swiglu``: the
  backward pass keeps gate and up only), so the MLP term now errs high by up to (cb + 8) bytes per
  element, on the safe side; the CPU peaks the tests compare with stay within MEMORY_TOLERANCE.
  It also predates the rematerialised RMSNorm (``layers.rms_norm``), which no longer keeps
  x / rms(x) and its scaled copy: two [B, T, D] arrays per norm, two norms per layer (measured in
  float32 on the 31M update on XLA:CPU: 611 MiB for 17 norms). The residual-stream term drops
  by 2 x (4 + cb) bytes per element accordingly, counting one of the two at the compute dtype so
  that bf16 is not under-predicted (exact at float32: 48 -> 32 bytes).
  """
  cb = _dtype_bytes(cfg.compute_dtype.value)
  heads = cfg.num_heads * cfg.head_dim // plan.shards_for(HEADS)
  return (
    (40 - 2 * cb) * cfg.embed_dim
    + (8 * cb + 40) * heads
    + (3 * cb + 8) * (cfg.mlp_dim // plan.shards_for(MLP))
  )


def _forward_rows(plan: StagePlan, w: Workload) -> int:
  rows = max(1, w.load // plan.shards_for(BATCH))
  if w.stage == Stage.UPDATE and plan.micro_batch_size:
    rows = max(1, plan.micro_batch_size // plan.shards_for(BATCH))
  return rows


def _scored(cfg: ModelConfig, plan: StagePlan, w: Workload, spec: DeviceSpec) -> MemoryEstimate:
  """Reference (forward only) and update (forward + backward) over [B, T] tokens."""
  pb, cb = _dtype_bytes(cfg.param_dtype.value), _dtype_bytes(cfg.compute_dtype.value)
  rows, t = _forward_rows(plan, w), w.length
  tp, f = plan.shards_for(HEADS), cfg.mlp_dim // plan.shards_for(MLP)
  d = cfg.embed_dim
  impl = _attention_impl(cfg, spec, t, False)
  attn = _attention_bytes(cfg, impl, rows, t, t, tp, causal=True)
  layer_act = 4 * rows * t * d * cb + 3 * rows * t * f * cb
  vocab = cfg.padded_vocab_size // plan.shards_for(VOCAB)
  logits = _LOGIT_COPIES * rows * min(w.logits_chunk, t) * vocab * 4
  full_rows = max(1, w.load // plan.shards_for(BATCH))
  io = full_rows * t * 13
  weights = param_elements_per_device(cfg, plan) * pb
  if w.stage == Stage.REFERENCE:
    # The layers and the logits chunks are live at different times: the peak is the larger
    # phase (the final hidden states stay live through the logits).
    logits = _REFERENCE_LOGIT_COPIES * rows * min(w.logits_chunk, t) * vocab * 4
    hidden = rows * t * d * 4
    return MemoryEstimate(weights, 0, 0, 0, max(attn + layer_act - logits, hidden), logits, io)
  # Backward: the peak is inside one layer's attention backward (naive: ~2-6 score-sized f32
  # buffers, measured on XLA:CPU). Without remat every layer also keeps what its backward reads;
  # with remat only its input, and the layer being differentiated recomputes its own.
  attn = _attention_bytes(
    cfg, impl, rows, t, t, tp, backward=True, remat=plan.remat != "none",
    unrolled=cfg.unrolled_forward(spec.platform, plan.remat), causal=True,
  )  # fmt: skip
  saved = rows * t * _saved_bytes_per_token(cfg, plan)
  if impl == "naive":  # its backward reads the layer's f32 probabilities (its causal blocks)
    saved += int(rows * (cfg.num_heads // tp) * t * t * 4 * _naive_score_fraction(t, True, True))
  if plan.remat == "none":
    saved = cfg.num_layers * saved
  else:
    saved = cfg.num_layers * rows * t * d * cb + saved
  micro = plan.micro_batch_size and plan.micro_batch_size < w.load
  return MemoryEstimate(
    weights=weights,
    optimizer=2 * param_elements_per_device(cfg, plan) * 4,
    gradients=weights * (2 if micro else 1),
    kv_cache=0,
    activations=saved + attn,
    logits=logits + rows * t * d * cb,  # the chunk plus the hidden-state gradient it feeds
    io=io,
  )


def estimate_memory(
  cfg: ModelConfig, plan: StagePlan, w: Workload, spec: DeviceSpec | None = None
) -> MemoryEstimate:
  """Predicted peak bytes per device of ``w.stage``'s program under ``plan`` on ``spec``."""
  if w.load < 1 or w.length < 1:
    raise ValueError(f"workload needs load >= 1 and length >= 1, got {w}")
  spec = spec or DEFAULT_SPEC
  return _rollout(cfg, plan, w, spec) if w.stage == Stage.ROLLOUT else _scored(cfg, plan, w, spec)


def _allreduce_seconds(spec: DeviceSpec, nbytes: float, t: int) -> float:
  if t <= 1:
    return 0.0
  return (t - 1) * spec.allreduce_latency_s + 2 * (t - 1) / t * nbytes / spec.link_bytes_per_s


def estimate_seconds(
  cfg: ModelConfig, plan: StagePlan, w: Workload, spec: DeviceSpec = DEFAULT_SPEC
) -> float:
  """Predicted wall time of one stage call of ``w`` under ``plan`` (see module docstring)."""
  pb, cb = _dtype_bytes(cfg.param_dtype.value), _dtype_bytes(cfg.compute_dtype.value)
  weight_bytes = param_elements_per_device(cfg, plan) * pb
  t = plan.axis_sizes[TENSOR]
  d, layers = cfg.embed_dim, cfg.num_layers
  rows = max(1, w.load // plan.shards_for(BATCH))
  flops_rate = spec.peak_flops * spec.flops_efficiency
  kv_token = 2 * layers * cfg.num_kv_heads * cfg.head_dim * cb / plan.shards_for(KV_HEADS)
  attn_flops = 4 * layers * cfg.num_heads * cfg.head_dim / plan.shards_for(HEADS)
  dense_flops = 2 * param_elements_per_device(cfg, plan)
  if w.stage == Stage.ROLLOUT:
    # One decode step: every weight and the whole cache are read once; compute for `rows` tokens.
    step_bytes = weight_bytes + rows * w.length * kv_token
    step_flops = rows * (dense_flops + attn_flops * w.length)
    step = max(step_flops / flops_rate, step_bytes / spec.hbm_bytes_per_s)
    step += 2 * layers * _allreduce_seconds(spec, rows * d * cb, t)
    prefill = rows * w.prompt_chunk * (dense_flops + attn_flops * w.length) / flops_rate
    return w.new_tokens * step + prefill
  tokens = rows * w.length
  flops = tokens * (dense_flops + attn_flops * w.length / 2)
  passes = 1
  if w.stage == Stage.UPDATE:
    passes = 3 + (1 if plan.remat != "none" else 0)  # backward ~2x forward, remat recomputes
  seconds = passes * max(flops / flops_rate, passes * weight_bytes / spec.hbm_bytes_per_s)
  seconds += passes * 2 * layers * _allreduce_seconds(spec, tokens * d * cb, t)
  fsdp = plan.shards_for(EMBED)
  if w.stage == Stage.UPDATE and fsdp > 1:  # gather weights for fwd and bwd, scatter grads
    seconds += 3 * _allreduce_seconds(spec, weight_bytes * fsdp / 2, fsdp)
  if w.stage == Stage.UPDATE and plan.micro_batch_size and plan.micro_batch_size < w.load:
    seconds += (w.load // plan.micro_batch_size) * layers * spec.allreduce_latency_s
  return seconds


def tokens_per_second(
  cfg: ModelConfig, plan: StagePlan, w: Workload, spec: DeviceSpec = DEFAULT_SPEC
) -> float:
  """Predicted tokens per second of the whole plan (rollout: generated tokens; else: scored)."""
  seconds = estimate_seconds(cfg, plan, w, spec)
  tokens = w.load * (w.new_tokens if w.stage == Stage.ROLLOUT else w.length)
  return tokens / seconds
