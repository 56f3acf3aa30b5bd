"""Everything a run can check before any device work: devices, files, layouts, a resumed config.

``Trainer.__init__`` runs ``check_run`` (and ``compare_config`` against the checkpoint it would
resume) before it builds the model, so a bad config, a missing file or a layout that does not
fit stops the run in seconds with one line naming the config key, instead of after model start-up
or a step's rollout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from earl_jax import config_lib
from earl_jax import model as model_lib
from earl_jax.parallel.plan import (
  ParallelPlan,
  ShardingError,
  make_stage_plan,
  validate_for_model,
)
from earl_jax.sampler import sampling
from earl_jax.types import BATCH, Stage


def make_plans(
  cfg: config_lib.ExperimentConfig,
  devices: Sequence[jax.Device],
  model_cfg: config_lib.ModelConfig | None = None,
) -> ParallelPlan:
  """The fixed per-stage layouts of ``cfg.parallel`` over ``devices``, validated for the model;
  a layout that does not fit raises ConfigError naming its config key."""
  model_cfg = model_cfg or cfg.model
  ids = [d.id for d in devices]
  plans = {}
  for stage in Stage:
    lay = cfg.parallel.layout(stage.value)
    try:
      plan = make_stage_plan(
        stage,
        ids,
        lay.data,
        lay.fsdp,
        lay.tensor,
        micro_batch_size=lay.micro_batch_size,
        remat=lay.remat,
      )
      batch = cfg.rollout.num_slots if stage is Stage.ROLLOUT else cfg.rl.batch_size
      validate_for_model(plan, model_cfg, batch)
    except ShardingError as e:  # fail closed, naming the layout key
      raise config_lib.ConfigError(
        f"{_layout_key(stage)} (data, fsdp, tensor)", (lay.data, lay.fsdp, lay.tensor), f"{e}"
      ) from None
    micro, shards = lay.micro_batch_size, plan.shards_for(BATCH)
    if micro and micro % shards:  # each wave / micro-batch is split over the batch shards
      raise config_lib.ConfigError(
        f"{_layout_key(stage)}.micro_batch_size",
        micro,
        f"0 or a multiple of the {stage.value} layout's {shards} batch shards",
      )
    plans[stage] = plan
  return ParallelPlan.of(plans)


def _layout_key(stage: Stage) -> str:
  return f"parallel.{stage.value}_layout"


def check_plans(cfg: config_lib.ExperimentConfig, devices, model_cfg) -> ParallelPlan:
  """``make_plans`` (mesh axes vs the device count and the model's dimensions, each stage's batch
  and micro-batch vs its batch shards), and the mini-batch vs the update's batch shards; every
  problem is a ConfigError naming its config key."""
  plans = make_plans(cfg, devices, model_cfg)
  upd = plans[Stage.UPDATE]
  shards = upd.shards_for(BATCH)
  mini = cfg.rl.batch_size // cfg.rl.mini_batches
  if mini % shards:
    raise config_lib.ConfigError(
      "rl.mini_batches",
      cfg.rl.mini_batches,
      f"a value whose mini-batch (batch {cfg.rl.batch_size} / mini_batches = {mini}) divides "
      f"over the update layout's {shards} batch shards",
    )
  return plans


def _reading(key: str, what: str):
  """Turns any failure of reading a file a config key names into a one-line ConfigError."""

  @contextlib.contextmanager
  def ctx():
    try:
      yield
    except config_lib.ConfigError:
      raise
    except Exception as e:
      cause = " ".join(f"{type(e).__name__}: {e}".split())[:400]
      raise config_lib.ConfigError(key, what, f"a readable path ({cause})") from None

  return ctx()


@dataclasses.dataclass(frozen=True)
class RunSetup:
  """What ``check_run`` found: the run's devices, tokenizer, model config and plans."""

  devices: list[jax.Device]
  tokenizer: model_lib.Tokenizer
  model_cfg: config_lib.ModelConfig
  pretrained_dir: str | None
  plans: ParallelPlan
  answer_ids: tuple[int, ...] = ()  # sampler.restrict_answers: the answer alphabet's token ids


def answer_alphabet(cfg: config_lib.ExperimentConfig) -> tuple[str, ...]:
  """The env's ``answer_alphabet`` under ``sampler.restrict_answers`` (``()`` without it), after
  the checks that need no tokenizer: the env has one, and under ``sampler.legal_answers`` it
  names its legal answers (under ``rl.loss.imitation_coef``, its expert's) and has at most
  ``sampling.MAX_ANSWERS``; ConfigError otherwise."""
  if not cfg.sampler.restrict_answers:
    return ()
  env = cfg.env.make()
  alphabet = getattr(env, "answer_alphabet", None)
  if not alphabet:
    raise config_lib.ConfigError(
      "sampler.restrict_answers", True, f"False: env {cfg.env.name!r} has no answer alphabet"
    )
  if cfg.sampler.legal_answers and not callable(getattr(env, "legal_answer_bits", None)):
    raise config_lib.ConfigError(
      "sampler.legal_answers", True, f"False: env {cfg.env.name!r} does not say which are legal"
    )
  coef = cfg.rl.loss.imitation_coef
  if coef > 0 and not callable(getattr(env, "expert_answer_bits", None)):
    raise config_lib.ConfigError(
      "rl.loss.imitation_coef",
      coef,
      f"0: env {cfg.env.name!r} has no scripted expert (expert_answer_bits)",
    )
  # Both per-turn masks (legal answers, the expert's) are int32 bit sets over the alphabet.
  for key, value, off in (
    ("sampler.legal_answers", cfg.sampler.legal_answers, "False"),
    ("rl.loss.imitation_coef", coef, "0"),
  ):
    if value and len(alphabet) > sampling.MAX_ANSWERS:
      raise config_lib.ConfigError(
        key,
        value,
        f"{off}: {len(alphabet)} answers, a per-turn answer mask holds <= {sampling.MAX_ANSWERS}",
      )
  return tuple(alphabet)


def answer_token_ids(cfg: config_lib.ExperimentConfig, tokenizer: model_lib.Tokenizer):
  """The token id of each answer in the env's ``answer_alphabet`` (``()`` unless
  ``sampler.restrict_answers``); an answer that is not exactly one token is a ConfigError."""
  alphabet = answer_alphabet(cfg)
  ids = []
  for answer in alphabet:
    encoded = tokenizer.encode(answer)
    if len(encoded) != 1:
      raise config_lib.ConfigError(
        "sampler.restrict_answers",
        True,
        f"False with this tokenizer: answer {answer!r} is {len(encoded)} tokens {encoded}, not one",
      )
    ids.append(int(encoded[0]))
  if len(set(ids)) != len(ids):
    raise config_lib.ConfigError(
      "sampler.restrict_answers", True, f"False: answers {alphabet} share tokens {ids}"
    )
  return tuple(ids)


def check_run(cfg: config_lib.ExperimentConfig) -> RunSetup:
  """Checks the device count, the tokenizer and pretrained files (no weights are read), the
  vocab size, every stage layout and the answer alphabet's tokens; raises a one-line ConfigError
  naming the key."""
  n = cfg.parallel.num_devices or jax.device_count()
  if n > jax.device_count():
    raise config_lib.ConfigError("parallel.num_devices", n, f"<= {jax.device_count()} devices")
  devices = jax.devices()[:n]
  with _reading("tokenizer.path", cfg.tokenizer.path):
    tokenizer = model_lib.make_tokenizer(cfg.tokenizer)
  model_cfg, pretrained_dir = cfg.model, None
  if cfg.pretrained_path:  # the checkpoint's config.json decides the architecture
    with _reading("pretrained_path", cfg.pretrained_path):
      model_cfg, pretrained_dir = model_lib.read_config(cfg.pretrained_path, cfg.model)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise config_lib.ConfigError(
      "model.vocab_size", model_cfg.vocab_size, f">= the tokenizer's {tokenizer.vocab_size}"
    )
  plans = check_plans(cfg, devices, model_cfg)
  answer_ids = answer_token_ids(cfg, tokenizer)
  return RunSetup(devices, tokenizer, model_cfg, pretrained_dir, plans, answer_ids)


def compare_config(
  cfg: config_lib.ExperimentConfig,
  step: int,
  meta: dict[str, Any],
  directory: Any,
  *,
  allow_config_change: bool,
) -> None:
  """Compares ``cfg`` with the config saved in checkpoint ``step``'s meta: run-only changes are
  logged; experiment changes raise ConfigChangedError unless allowed (then logged)."""
  saved = meta.get("config")
  if saved is None:
    return
  experiment, run_only = config_lib.config_changes(saved, cfg)
  if run_only:
    logging.warning("resuming step %d with changed run settings: %s", step, "; ".join(run_only))
  if experiment and not allow_config_change:
    raise config_lib.ConfigChangedError(step, directory, experiment)
  if experiment:
    logging.warning(
      "resuming step %d with a changed experiment (allowed): %s", step, "; ".join(experiment)
    )
