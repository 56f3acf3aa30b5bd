"""earl_jax against eager PyTorch (transformers) on the same Qwen2 checkpoint: generate, reference
log-probs and one update step, timed side by side.

  PYTHONPATH=. python benchmarks/peers.py [--sizes tiny,30m] [--work generate,reference,update]
      [--devices 1,8] [--repeats 3] [--threads 2]

For each model size a random Qwen2 checkpoint is written with transformers (or --checkpoint DIR is
used), loaded into earl_jax (``from_pretrained``) and into ``transformers.AutoModelForCausalLM``
(sdpa attention, ``torch.inference_mode`` where no gradient is needed: what a PyTorch user runs).
Before anything is timed, both sides are checked to compute the same thing: the reference
log-probs (max abs difference), the update's loss and gradient norm, and the greedy tokens (every
token earl_jax picks must be a torch argmax up to 1e-4 in logits, so ties cannot fail it).

Work, all float32:
  generate   greedy, 32-token prompts, B 8 and 32, 64 and 256 new tokens (no stop token, so every
             row decodes every token); new tokens/s. HF: ``model.generate`` with the KV cache.
  reference  log p(token) of B 32 x T 288 packed rows; tokens/s.
  update     one policy-gradient step (forward, backward, AdamW with global-norm clipping) on the
             same batch; seconds per step. earl_jax: the update program the trainer runs (PPO
             objective, one optimiser step, so the ratio is 1); torch: the same loss written out.
             One row per --micro_batch: the whole batch at once (0), or gradients accumulated
             over micro-batches of that many rows, both sides alike (earl_jax: the plan's
             micro_batch_size; torch: one backward per micro-batch, every loss divided by the
             whole batch's token count), checked to give the same loss and gradient norm.

earl_jax runs on 1 device and on the default mesh (--devices; N devices = data-parallel N, the
default run's layout). Each side runs in its own process (see ``Remote``); the CPU devices are
simulated (XLA_FLAGS, set below), PyTorch uses --threads threads. Every worker runs on the same
memory allocator (--allocator; default the system's). With glibc's malloc each buffer over 32 MiB
is a fresh mmap whose pages the kernel faults in and zeroes on every call (measured: 5.4 GB of
page faults per 30M update step); a preloaded tcmalloc or jemalloc keeps and reuses them. In an
earlier session that made the 30M update 1.4-1.6x faster on the earl_jax side and 1.04-1.2x on
torch's (two runs, before the order effect below was known: earl_jax ran right after torch), but
it holds on to the memory: with ``--devices 1,8`` the 8-device worker grew past 12 GB and the
kernel killed it on a 24 GB machine, so it is an option, not the default. ``--allocator thp``
keeps glibc's malloc and starts every worker with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, as
``launch/train.py`` starts the trainer (``earl_jax.hostmem``): the kernel then faults those
buffers in 2 MiB at a time (measured: 1.5 million faults per 30M update step become 8 thousand),
without holding on to the memory.
Repetitions are interleaved (every variant once per round, --pause seconds idle before each call;
each round starts one column later, so no side always runs right after the same other one; with
two columns a side runs right after the other in one round and right after itself in the next); the
table gives the median and the range; compile time is measured apart and never counted in the
throughput.

The time of a memory-heavy call depends on how long its process idled before it. XLA:CPU mallocs a
program's temp buffer on every call (4.0 GB for the 30M update of the whole batch, 5.5 GB before
the softmax rule and the RMSNorm remat; 1.3 GB in micro-batches of 8 rows) and glibc hands it
back to the kernel when the call ends. The 2-core development machines are Firecracker VMs
whose virtio-balloon reports free memory to the hypervisor
(free page reporting: feature bit 5 in /sys/bus/virtio/drivers/virtio_balloon/*/features, blocks of
2 MiB, about 2 s after they are freed), and memory touched again after that costs a fault in the
hypervisor too, which the guest sees as kernel time. Measured in one earl_jax process (30M, 1
device, huge pages; AMD EPYC family 25), the same program repeated: the micro-batched update took
10.7-11.0 s with 0.6-0.7 s of kernel time back to back and 12.5-12.7 s with 3.5 s right after 5 s
idle; the whole batch 11.8-12.1 s with 3.0-3.2 s back to back and 13.0 s with 6.0 s after 5 s idle,
with as many page faults each time. Here each side idles through the other's turn, so both pay it on
every call, and a shorter --pause does not avoid it (both sides on huge pages: earl_jax's
whole-batch update 18.1 s at 0.5 s, 17.3 s at 2 s). An earlier session saw it as an order effect:
the worker called right after torch, or after 10 s pauses, took 14.5-16.4 s, the others 11.3-12.8 s.
The idle, not torch, is the cause. The trainer runs its stages back to back. Rerun before trusting a
difference under about 20% in the whole-batch row; the micro-batch row, with a quarter of the
working set, pays less.
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from earl_jax import hostmem
from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.parallel import executables as ex
from earl_jax.parallel import mesh as mesh_lib
from earl_jax.parallel.plan import make_stage_plan
from earl_jax.rl import batches, losses, objective, programs, update
from earl_jax.sampler import engine
from earl_jax.types import Stage

# Compile times are measured: never loaded from a persistent compilation cache the environment
# may name (JAX_COMPILATION_CACHE_DIR; the test suite sets one).
jax.config.update("jax_enable_compilation_cache", False)

SIZES = {
  # The default run's model (configs/connect_four_tiny.py) as a Qwen2 checkpoint.
  "tiny": dict(
    vocab_size=105, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
  ),
  # ~34M parameters (untied lm-head): the size where the work, not fixed overheads, dominates.
  "30m": dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2,
  ),
}  # fmt: skip
PROMPT = 32
REF_B, REF_T, CHUNK = 32, 288, 96
LR = 1e-5


def write_checkpoint(path: str, size: str) -> None:
  """Writes a random Qwen2 checkpoint of ``size`` to ``path``."""
  config = transformers.Qwen2Config(
    **SIZES[size], max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False
  )
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(config)
  with torch.no_grad():  # wider than HF's init (std 0.02), so greedy argmaxes are not near-ties
    for name, p in model.named_parameters():
      if "norm" not in name:
        p.normal_(0.0, 0.08)
  model.save_pretrained(path)


@dataclasses.dataclass
class Result:
  times: list[float] = dataclasses.field(default_factory=list)
  per_second: float = 0.0  # work units (tokens) per call; 0: report seconds

  def cell(self) -> str:
    t = sorted(self.times)
    med = statistics.median(t)
    if self.per_second:
      lo, hi = self.per_second / t[-1], self.per_second / t[0]
      return f"{self.per_second / med:,.0f} ({lo:,.0f}-{hi:,.0f})"
    return f"{med:.3f} s ({t[0]:.3f}-{t[-1]:.3f})"

  def rate(self) -> float:
    med = statistics.median(self.times)
    return self.per_second / med if self.per_second else 1.0 / med


def _timed(fn: Callable[[], object]) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# Inputs shared by both sides


def _batch(vocab: int, b: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Packed rows of random lengths in [t/2, t], the second half of each row is the policy's."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(t // 2, t + 1, size=b)
  tokens = rng.integers(0, vocab, size=(b, t)).astype(np.int32)
  valid = np.arange(t)[None, :] < lengths[:, None]
  tokens = np.where(valid, tokens, 0)
  loss_mask = valid & (np.arange(t)[None, :] >= (lengths // 2)[:, None])
  adv = np.repeat(rng.standard_normal(b).astype(np.float32)[:, None], t, axis=1) * loss_mask
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  return dict(tokens=tokens, valid=valid, loss_mask=loss_mask, adv=adv, positions=positions)


def _advantage_batch(d: dict[str, np.ndarray]) -> batches.AdvantageBatch:
  b, t = d["tokens"].shape
  zeros = np.zeros((b, t), np.float32)
  return batches.AdvantageBatch(
    tokens_BxT=d["tokens"], positions_BxT=d["positions"], valid_BxT=d["valid"],
    loss_mask_BxT=d["loss_mask"], sampler_logps_BxT=zeros,
    rewards_B=np.zeros((b,), np.float32), group_ids_B=np.zeros((b,), np.int32),
    token_rewards_BxT=zeros, answer_bits_BxT=np.full((b, t), -1, np.int32),
    expert_bits_BxT=np.zeros((b, t), np.int32),
    ref_logps_BxT=zeros, old_logps_BxT=zeros,
    advantages_BxT=d["adv"], returns_BxT=zeros,
  )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# earl_jax


class JaxSide:
  """The stage programs of earl_jax for one model on ``n`` devices (data-parallel)."""

  def __init__(self, ckpt: str, n: int):
    settings = ModelConfig(max_seq_len=1024, attention=os.environ.get("PEERS_ATTENTION", "auto"))
    self.cfg, model = model_lib.from_pretrained(ckpt, settings)
    self.graphdef, state = nnx.split(model)
    self.abstract = jax.eval_shape(lambda: state)
    self.n = n
    self.plans = {s: make_stage_plan(s, list(range(n)), -1, 1, 1) for s in Stage}
    self.state = {
      s: jax.device_put(state, mesh_lib.state_shardings(self.abstract, p))
      for s, p in self.plans.items()
    }
    self.compile_seconds: dict[str, float] = {}
    self._programs: dict[str, jax.stages.Compiled] = {}

  def _compiled(self, key: str, lower: Callable[[], jax.stages.Lowered]):
    if key not in self._programs:
      start = time.perf_counter()
      self._programs[key] = lower().compile()
      self.compile_seconds[key] = time.perf_counter() - start
    return self._programs[key]

  def _rows(self, stage: Stage, x: np.ndarray) -> jax.Array:
    return jax.device_put(x, mesh_lib.batch_sharding(self.plans[stage], x.ndim))

  # reference
  def reference(self, d: dict[str, np.ndarray]) -> Callable[[], np.ndarray]:
    b, t = d["tokens"].shape
    plan = self.plans[Stage.REFERENCE]
    score = self._compiled(
      "reference",
      lambda: programs.lower_score(plan, self.graphdef, self.abstract, (b, t), chunk_size=CHUNK),
    )
    args = [self._rows(Stage.REFERENCE, d[k]) for k in ("tokens", "positions", "valid")]
    params = self.state[Stage.REFERENCE]
    return lambda: np.asarray(jax.block_until_ready(score(params, *args)))

  # update
  def update(self, d: dict[str, np.ndarray], micro: int = 0) -> Callable[[], dict[str, float]]:
    plan = dataclasses.replace(self.plans[Stage.UPDATE], micro_batch_size=micro)
    optimizer = update.make_optimizer(update.OptimConfig(learning_rate=LR, max_grad_norm=1.0))
    obj = objective.Objective(losses.LossConfig(), chunk_size=CHUNK, old_from_new=True)
    batch = jax.tree.map(lambda x: self._rows(Stage.UPDATE, x), _advantage_batch(d))
    abstract_batch = jax.eval_shape(lambda: batch)
    abstract_train = jax.eval_shape(
      lambda: update.init_train_state(self.abstract, optimizer, jax.random.key(0))
    )
    step = self._compiled(
      f"update mb{micro}" if micro else "update",
      lambda: programs.lower_update(
        plan,
        self.graphdef,
        abstract_train,
        abstract_batch,
        loss_fn=obj,
        optimizer=optimizer,
        totals_fn=obj.totals,
      ),
    )
    shardings = ex.train_state_shardings(plan, abstract_train, optimizer)
    fresh = jax.jit(
      lambda p: update.init_train_state(p, optimizer, jax.random.key(0)), out_shardings=shardings
    )
    holder = {"state": fresh(self.state[Stage.UPDATE])}

    def run() -> dict[str, float]:
      holder["state"], metrics = step(holder["state"], batch)
      m = jax.device_get(metrics)
      return {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}

    return run

  # generate
  def generate(self, prompts: np.ndarray, new: int) -> Callable[[], np.ndarray]:
    b, p = prompts.shape
    plan = self.plans[Stage.ROLLOUT]
    spec = engine.GenerationSpec(max_new_tokens=new)
    gen = self._compiled(
      f"generate B{b} N{new}",
      lambda: ex.lower_generate(plan, self.graphdef, self.abstract, p + new, spec, (b, p)),
    )
    cache_sh = ex.cache_shardings(
      plan, jax.eval_shape(lambda: model_lib.init_cache(self.cfg, b, p + new))
    )
    make_cache = jax.jit(lambda: model_lib.init_cache(self.cfg, b, p + new), out_shardings=cache_sh)
    tokens = self._rows(Stage.ROLLOUT, prompts.astype(np.int32))
    mask = self._rows(Stage.ROLLOUT, np.ones((b, p), bool))
    pos = self._rows(Stage.ROLLOUT, np.broadcast_to(np.arange(p, dtype=np.int32), (b, p)).copy())
    active = self._rows(Stage.ROLLOUT, np.ones((b,), bool))
    rng = jax.device_put(jax.random.key(0), ex.replicated(plan))
    params = self.state[Stage.ROLLOUT]

    def run() -> np.ndarray:
      cache = make_cache()  # part of the work: a rollout starts from an empty cache
      out, _ = gen(params, cache, tokens, mask, pos, active, rng)
      return np.asarray(out.tokens_BxN)

    return run


# ----------------------------------------------------------------------------------------------
# PyTorch


class TorchSide:
  def __init__(self, ckpt: str):
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
      ckpt, dtype=torch.float32, attn_implementation="sdpa"
    )
    self.vocab_size = self.model.config.vocab_size
    self.num_parameters = sum(p.numel() for p in self.model.parameters())
    # Each update variant starts from the checkpoint's weights, as earl_jax's does (its train
    # state is built afresh): the checks compare the first step of each.
    self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}

  def _logps(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    logits = self.model(input_ids=tokens, attention_mask=valid.long()).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = torch.gather(logp, -1, tokens[:, 1:, None])[..., 0]
    scored = valid[:, 1:] & valid[:, :-1]
    return torch.nn.functional.pad(picked * scored, (1, 0))

  def reference(self, d: dict[str, np.ndarray]) -> Callable[[], np.ndarray]:
    tokens = torch.as_tensor(d["tokens"]).long()
    valid = torch.as_tensor(d["valid"])
    self.model.eval()

    def run() -> np.ndarray:
      with torch.inference_mode():
        return self._logps(tokens, valid).numpy()

    return run

  def update(self, d: dict[str, np.ndarray], micro: int = 0) -> Callable[[], dict[str, float]]:
    """``micro`` > 0: gradients accumulated over micro-batches of that many rows, each loss
    divided by the whole batch's token count (the same loss and gradient)."""
    tokens = torch.as_tensor(d["tokens"]).long()
    valid = torch.as_tensor(d["valid"])
    mask = torch.as_tensor(d["loss_mask"]).float()
    adv = torch.as_tensor(d["adv"])
    model = self.model
    model.load_state_dict(self.initial)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8)
    model.train()  # dropout is 0 in Qwen2; train mode only switches the caching off

    step = micro or tokens.shape[0]

    def run() -> dict[str, float]:
      opt.zero_grad(set_to_none=True)
      total = 0.0
      for i in range(0, tokens.shape[0], step):
        rows = slice(i, i + step)
        logp = self._logps(tokens[rows], valid[rows])
        ratio = torch.exp(logp - logp.detach())  # = 1: one optimiser step on the batch
        loss = -(adv[rows] * ratio * mask[rows]).sum() / mask.sum()
        loss.backward()
        total += loss.item()
      norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      opt.step()
      return {"loss": total, "grad_norm": norm.item()}

    return run

  def generate(self, prompts: np.ndarray, new: int) -> Callable[[], np.ndarray]:
    ids = torch.as_tensor(prompts).long()
    self.model.eval()

    def run() -> np.ndarray:
      with torch.inference_mode():
        out = self.model.generate(
          input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
          min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
      return out[:, ids.shape[1] :].numpy()

    return run

  def greedy_gap(self, prompts: np.ndarray, generated: np.ndarray) -> float:
    """Largest (max logit - logit of the token picked) along earl_jax's greedy continuation."""
    seq = torch.as_tensor(np.concatenate([prompts, generated], axis=1)).long()
    with torch.inference_mode():
      logits = self.model(input_ids=seq).logits[:, prompts.shape[1] - 1 : -1].float()
    picked = torch.gather(logits, -1, seq[:, prompts.shape[1] :, None])[..., 0]
    return float((logits.max(-1).values - picked).max())


# ----------------------------------------------------------------------------------------------


# --allocator: the library preloaded into every worker, and its settings (jemalloc: never hand
# memory back, so a step's big buffers are reused by the next instead of faulted in again).
ALLOCATORS = {
  "tcmalloc": ("tcmalloc_minimal", {}),
  "jemalloc": ("jemalloc", {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}),
}


def allocator_env(choice: str) -> tuple[str, dict[str, str]]:
  """(description, environment for the workers) of --allocator ``choice``; "auto" takes the
  first of tcmalloc, jemalloc that is installed, else the system's malloc; a named one that is
  not installed is an error."""
  if choice == "system":
    return "system malloc", {}
  if choice == "thp":  # what launch/train.py starts with (earl_jax.hostmem)
    env = hostmem.thp_environ({})
    if env is None:
      sys.exit("--allocator thp: needs glibc >= 2.35 and transparent huge pages in the kernel")
    return "system+thp malloc (glibc.malloc.hugetlb=1)", env
  names = list(ALLOCATORS) if choice == "auto" else [choice]
  for name in names:
    lib = ctypes.util.find_library(ALLOCATORS[name][0])
    if lib:
      return f"{name} ({lib})", {"LD_PRELOAD": lib, **ALLOCATORS[name][1]}
  if choice != "auto":
    sys.exit(
      f"--allocator {choice}: lib{ALLOCATORS[choice][0]} is not installed (Debian: "
      f"apt install {'libtcmalloc-minimal4' if choice == 'tcmalloc' else 'libjemalloc2'})"
    )
  return "system malloc (no tcmalloc or jemalloc installed)", {}


def _loaded_allocator() -> str:
  """Which preloadable allocator this process really runs on (read off its memory map), and
  whether glibc's started on transparent huge pages."""
  with open("/proc/self/maps") as maps:
    text = maps.read()
  name = next((name for name in ALLOCATORS if f"lib{name}" in text), "system")
  thp = hostmem.setting(os.environ) == "1"
  return f"{name}+thp" if name == "system" and thp else name


class _Failure(str):
  """An exception raised in a worker, sent back as its repr."""


def _serve(conn, kind: str, ckpt: str, n: int, threads: int) -> None:
  """A worker process holding one side; answers (op, name, args) messages until None."""
  if kind == "torch":
    torch.set_num_threads(threads)
    side = TorchSide(ckpt)
  else:
    side = JaxSide(ckpt, n)
  fns: list[Callable] = []
  while (msg := conn.recv()) is not None:
    op, name, args = msg
    try:
      if op == "build":
        fns.append(getattr(side, name)(*args))
        out = len(fns) - 1
      elif op == "call":
        out = fns[name]()
      elif op == "time":
        out = _timed(fns[name])  # timed inside the worker: no pipe in the figure
      elif op == "get":
        out = _loaded_allocator() if name == "allocator" else getattr(side, name)
      else:
        out = getattr(side, name)(*args)
    except BaseException as e:  # reported to the parent, which stops
      out = _Failure(f"{type(e).__name__}: {e}")
    conn.send(out)


class Remote:
  """A TorchSide or JaxSide in its own process (spawned, so each has a fresh runtime).

  Measured why: after one torch update step in the same process, the XLA update program ran
  ~40% slower for good (19-21 s instead of 13.5-15 s, still after 10 s idle): the two runtimes
  share the process's allocator and threads. Separate processes keep either from taxing the other.
  """

  def __init__(self, kind: str, ckpt: str, n: int = 0, threads: int = 1, env=None):
    ctx = multiprocessing.get_context("spawn")
    self.conn, child = ctx.Pipe()
    self.proc = ctx.Process(target=_serve, args=(child, kind, ckpt, n, threads), daemon=True)
    saved = dict(os.environ)
    os.environ.update(env or {})  # a spawned worker is a fresh interpreter: it starts with these
    try:
      self.proc.start()
    finally:
      os.environ.clear()
      os.environ.update(saved)
    self.kind, self.n = kind, n

  def _ask(self, op: str, name, *args):
    self.conn.send((op, name, args))
    out = self.conn.recv()
    if isinstance(out, _Failure):
      raise SystemExit(f"{self.kind} worker ({self.n} devices): {out}")
    return out

  def _build(self, name: str, *args) -> Callable:
    i = self._ask("build", name, *args)
    fn = lambda: self._ask("call", i)  # noqa: E731
    fn.timed = lambda: self._ask("time", i)
    return fn

  def reference(self, d):
    return self._build("reference", d)

  def update(self, d, micro: int = 0):
    return self._build("update", d, micro)

  def generate(self, prompts, new):
    return self._build("generate", prompts, new)

  def greedy_gap(self, prompts, generated) -> float:
    return self._ask("method", "greedy_gap", prompts, generated)

  def get(self, name: str):
    return self._ask("get", name)

  def close(self) -> None:
    self.conn.send(None)
    self.proc.join(timeout=60)


def _checks(torch_side: TorchSide, jax_sides: list[JaxSide], d, prompts) -> list[str]:
  """Both sides compute the same thing (raises otherwise); returns what was checked."""
  out = []
  ref_t = torch_side.reference(d)()
  for js in jax_sides:
    err = float(np.abs(js.reference(d)() - ref_t).max())
    out.append(f"reference log-probs, {js.n} device(s): max |diff| {err:.1e}")
    if err > 2e-3:
      raise SystemExit(f"earl_jax and torch reference log-probs differ by {err}")
    gen = js.generate(prompts[:8], 16)()
    gap = torch_side.greedy_gap(prompts[:8], gen)
    out.append(f"greedy tokens, {js.n} device(s): worst logit gap to torch's argmax {gap:.1e}")
    if gap > 1e-3:
      raise SystemExit(f"earl_jax greedy tokens are not torch's argmax (gap {gap})")
  return out


def _update_check(torch_run, jax_runs) -> list[str]:
  """First step of each side from the same weights: same loss and gradient norm."""
  t = torch_run()
  out = [f"update step 1, torch: loss {t['loss']:.6f}, grad norm {t['grad_norm']:.6f}"]
  for n, run in jax_runs:
    j = run()
    out.append(
      f"update step 1, {n} device(s): loss {j['loss']:.6f}, grad norm {j['grad_norm']:.6f}"
    )
    for k in ("loss", "grad_norm"):
      if abs(j[k] - t[k]) > 1e-3 * max(1.0, abs(t[k])):
        raise SystemExit(f"update {k}: earl_jax {j[k]} vs torch {t[k]}")
  return out


def _time_interleaved(variants, args) -> dict[str, dict[str, Result]]:
  """One warm-up call of every variant, then ``args.repeats`` rounds taking turns, each round's
  order rotated by one."""
  results = {
    row: {col: Result(per_second=u) for col, (_, u) in cols.items()}
    for row, cols in variants.items()
  }
  for cols in variants.values():  # warm-up (compiled already; first-call allocations)
    for fn, _ in cols.values():
      fn()
  for r in range(args.repeats):
    for row, cols in variants.items():
      # Each round starts one column later: no side always runs right after the same other one
      # (the process called right after torch ran the same XLA program up to 1.3x slower).
      order = list(cols)[r % len(cols) :] + list(cols)[: r % len(cols)]
      for col in order:
        time.sleep(args.pause)  # the previous call's worker threads wind down (see --pause)
        results[row][col].times.append(cols[col][0].timed())
  return results


def _print_table(results: dict[str, dict[str, Result]], args) -> None:
  cols = ["torch"] + [f"jax {n}" for n in args.devices]
  print(
    f"\nmedian (range) of {args.repeats} interleaved repetitions, {args.pause:g} s idle before "
    f"each; torch {args.threads} threads, jax N = N simulated CPU devices (data-parallel); "
    "ratio = jax / torch speed\n"
  )
  head = " | ".join(cols) + " | " + " | ".join(f"ratio jax {n}" for n in args.devices)
  print(f"| work | {head} |")
  print("|---" * (1 + len(cols) + len(args.devices)) + "|")
  for row, res in results.items():
    ratios = " | ".join(
      f"{res[f'jax {n}'].rate() / res['torch'].rate():.2f}x" for n in args.devices
    )
    print(f"| {row} | " + " | ".join(res[c].cell() for c in cols) + f" | {ratios} |")


def bench_size(size: str, args) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = args.checkpoint or tmp
    if not args.checkpoint:
      write_checkpoint(tmp, size)
    allocator, env = allocator_env(args.allocator)
    torch_side = Remote("torch", ckpt, threads=args.threads, env=env)
    jax_sides = [Remote("jax", ckpt, n, env=env) for n in args.devices]
    loaded = {side.get("allocator") for side in [torch_side, *jax_sides]}
    want = {allocator.split(" ")[0] if env else "system"}
    if loaded != want:
      sys.exit(f"workers run on {sorted(loaded)}, not {allocator}")
    print(f"allocator in every worker: {allocator}")
    vocab, params = torch_side.get("vocab_size"), torch_side.get("num_parameters")
    d = _batch(vocab, REF_B, REF_T)
    prompts = np.random.default_rng(1).integers(0, vocab, size=(32, PROMPT)).astype(np.int32)
    name = size if not args.checkpoint else args.checkpoint
    print(f"\n## {name}: {params / 1e6:.2f}M parameters, float32\n")
    for line in _checks(torch_side, jax_sides, d, prompts):
      print(f"- {line}")

    variants: dict[str, dict[str, tuple[Callable, float]]] = {}  # row -> column -> (fn, units)
    if "generate" in args.work:
      for b in (8, 32):
        for new in args.new_tokens:
          row = f"generate B{b} +{new} (new tok/s)"
          variants[row] = {"torch": (torch_side.generate(prompts[:b], new), b * new)}
          for js in jax_sides:
            variants[row][f"jax {js.n}"] = (js.generate(prompts[:b], new), b * new)
    if "reference" in args.work:
      row = f"reference B{REF_B} T{REF_T} (tok/s)"
      variants[row] = {"torch": (torch_side.reference(d), REF_B * REF_T)}
      for js in jax_sides:
        variants[row][f"jax {js.n}"] = (js.reference(d), REF_B * REF_T)
    for micro in args.micro_batch if "update" in args.work else ():
      work = f"update B{REF_B} T{REF_T}" + (f", micro-batches of {micro}" if micro else "")
      row = f"{work} (s/step)"
      runs = [(js.n, js.update(d, micro)) for js in jax_sides]
      t_run = torch_side.update(d, micro)
      for line in _update_check(t_run, runs):
        print(f"- {work}: {line}")
      variants[row] = {"torch": (t_run, 0)}
      for n, run in runs:
        variants[row][f"jax {n}"] = (run, 0)

    _print_table(_time_interleaved(variants, args), args)
    print("\ncompile seconds (earl_jax, not counted above):")
    for js in jax_sides:
      compiled = js.get("compile_seconds")
      print(f"- {js.n} device(s): " + ", ".join(f"{k} {v:.1f}" for k, v in compiled.items()))
    for side in [torch_side, *jax_sides]:
      side.close()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="tiny,30m")
  parser.add_argument("--work", default="generate,reference,update")
  parser.add_argument("--devices", default="1,8", help="earl_jax device counts to compare")
  parser.add_argument("--new_tokens", default="64,256")
  parser.add_argument(
    "--micro_batch",
    default="0,8",
    help="update rows: rows per micro-batch, both sides alike (gradients accumulated; 0 = the "
    "whole batch at once)",
  )
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument(
    "--pause",
    type=float,
    default=2.0,
    help="seconds of idle before every timed call: torch's OpenMP threads keep spinning for a "
    "while after a call, taking the cores from the next process's measurement",
  )
  parser.add_argument("--checkpoint", default="", help="an existing HF Qwen2/Llama checkpoint")
  parser.add_argument(
    "--allocator",
    default="system",
    choices=["system", "thp", "tcmalloc", "jemalloc", "auto"],
    help="memory allocator of every worker, both sides alike (thp: glibc's on transparent huge "
    "pages, as launch/train.py starts; tcmalloc/jemalloc: preloaded, faster, holds more memory; "
    "auto: tcmalloc, else jemalloc, else the system's)",
  )
  args = parser.parse_args()
  args.devices = [int(x) for x in args.devices.split(",")]
  args.new_tokens = [int(x) for x in args.new_tokens.split(",")]
  args.micro_batch = [int(x) for x in args.micro_batch.split(",")]
  bad = [m for m in args.micro_batch if m < 0 or (m and REF_B % m)]
  if bad:
    sys.exit(f"--micro_batch {bad[0]}: rows per micro-batch must be 0 or divide the batch {REF_B}")
  args.work = args.work.split(",")
  if max(args.devices) > jax.device_count():
    sys.exit(f"--devices {max(args.devices)} > {jax.device_count()} devices (XLA_FLAGS)")
  torch.set_num_threads(args.threads)
  print(
    f"backend {jax.default_backend()}, {jax.device_count()} devices, {os.cpu_count()} cores "
    f"({hostmem.cpu_description()}); "
    f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}"
  )
  for size in args.sizes.split(","):
    bench_size(size, args)


if __name__ == "__main__":
  main()
