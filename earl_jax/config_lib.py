"""Typed, validated configuration: the edge between ml_collections files and the library.

``configs/*.py`` build an ``ml_collections.ConfigDict``; ``from_config_dict`` turns it into the
frozen dataclasses below, and every library function takes those dataclasses, never the dict.
Validation happens here, before any compute: an unknown key, a wrong type or an impossible value
raises ``ConfigError`` naming the key path, the value and what is allowed.

This is the only library module that imports ml_collections.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import ml_collections

from earl_jax import config_build
from earl_jax.config_build import to_dict
from earl_jax.env import baselines as baselines_env
from earl_jax.env import calculator as calculator_env
from earl_jax.env import games as games_env
from earl_jax.env import opponents as opponents_env
from earl_jax.env import parsing as parsing_env
from earl_jax.env import registry as env_registry
from earl_jax.model.config import (  # the model's config lives with the model
  ModelConfig,
  TokenizerConfig,
  TokenizerKind,
)
from earl_jax.rl.advantage import AdvantageConfig
from earl_jax.rl.losses import LossConfig
from earl_jax.rl.rollout import RolloutConfig
from earl_jax.rl.update import OptimConfig
from earl_jax.sampler import sampling
from earl_jax.types import ConfigError, DType


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
  if not ok:
    raise ConfigError(key, value, allowed)


# ----------------------------------------------------------------------------------------------
# Environment, sampling, RL, parallelism, training


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Which environment, and the options of each kind (only the one named is used)."""

  name: str = "connect_four"
  game: games_env.GameEnvConfig = dataclasses.field(default_factory=games_env.GameEnvConfig)
  calculator: calculator_env.CalculatorEnvConfig = dataclasses.field(
    default_factory=calculator_env.CalculatorEnvConfig
  )

  def __post_init__(self):
    _require(self.name in env_registry.names(), "name", self.name, f"one of {env_registry.names()}")
    # The env checks its options against the game itself (e.g. an observation the game has no
    # rendering for): built once here, so a bad combination fails before any device work.
    section = "calculator" if self.name == env_registry.CALCULATOR else "game"
    try:
      self.make()
    except ConfigError as e:
      raise ConfigError(f"{section}.{e.key}", e.value, e.allowed) from None

  def make(self, **overrides: Any):
    """A fresh env instance (``overrides`` replace config fields, e.g. the eval opponent)."""
    section = self.calculator if self.name == env_registry.CALCULATOR else self.game
    return env_registry.make(self.name, **{**dataclasses.asdict(section), **overrides})

  def evaluations(self, opponents: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """(metric name, ``make`` overrides) per evaluation suite; the env decides (see
    ``env.registry.evaluations``)."""
    return env_registry.evaluations(self.name, opponents)

  @property
  def success(self) -> str:
    """The outcome the headline rate counts: ``win`` in games, ``correct`` for the calculator."""
    return "correct" if self.name == env_registry.CALCULATOR else "win"

  def baselines(
    self, specs: tuple[str, ...], opponents: tuple[str, ...], seeds: range
  ) -> dict[str, dict[str, float]]:
    """{baseline spec: {eval suite: win rate}}: each scripted policy in ``specs`` played on the
    policy's side against each evaluation suite, on ``seeds`` (games only)."""
    return baselines_env.table(specs, self.evaluations(opponents), self.make, seeds)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  strategy: str = "temperature"  # training rollouts: greedy | temperature | top_k | top_p
  temperature: float = 1.0
  top_k: int = 0  # top_k strategy only
  top_p: float = 1.0  # top_p strategy only
  eval_strategy: str = "greedy"  # evaluation games: same choices
  restrict_answers: bool = False  # decode each answer as one token of the env's answer alphabet
  legal_answers: bool = False  # ...and only the answers legal this turn (action masking)

  def __post_init__(self):
    try:
      self.make()
    except ConfigError as e:  # the strategies name their own fields (p, k); name the config's
      raise ConfigError(
        {"p": "top_p", "k": "top_k"}.get(e.key, e.key), e.value, e.allowed
      ) from None
    if self.eval_strategy not in ("greedy", "temperature", "top_k", "top_p"):
      raise ConfigError("eval_strategy", self.eval_strategy, "greedy | temperature | top_k | top_p")
    _require(
      isinstance(self.restrict_answers, bool), "restrict_answers", self.restrict_answers, "a bool"
    )
    _require(isinstance(self.legal_answers, bool), "legal_answers", self.legal_answers, "a bool")
    _require(
      self.restrict_answers or not self.legal_answers,
      "legal_answers",
      self.legal_answers,
      "False without restrict_answers (the legal answers are a subset of the answer alphabet)",
    )

  def make(
    self, *, evaluation: bool = False, answer_ids: tuple[int, ...] = ()
  ) -> sampling.Strategy:
    """The strategy of training rollouts (or of evaluation games), restricted to ``answer_ids``
    when given (``RunSetup.answer_ids``: non-empty exactly when ``restrict_answers``), and then
    per row to the legal ones under ``legal_answers``."""
    name = self.eval_strategy if evaluation else self.strategy
    return sampling.make_strategy(
      name,
      temperature=self.temperature,
      top_k=self.top_k,
      top_p=self.top_p,
      allowed=answer_ids,
      per_row=self.legal_answers and bool(answer_ids),
    )


@dataclasses.dataclass(frozen=True)
class RLConfig:
  num_groups: int = 8  # P: initial states (prompts) per step
  group_size: int = 4  # G: episodes per initial state (GRPO group)
  logp_chunk: int = 64  # sequence chunk of the log-prob computation (bounds the [B, C, V] block)
  ppo_epochs: int = 1  # passes over each rollout batch
  mini_batches: int = 1  # optimiser steps per pass (the batch is shuffled and split)
  advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
  loss: LossConfig = dataclasses.field(default_factory=LossConfig)
  # Steps whose rollouts record the env's expert labels for loss.imitation_coef (a warm-up: later
  # steps have no labels, so the term is 0 and the run is pure RL); 0 = every step.
  imitation_steps: int = 0

  def __post_init__(self):
    for key in ("num_groups", "group_size", "logp_chunk", "ppo_epochs", "mini_batches"):
      _require(getattr(self, key) >= 1, key, getattr(self, key), "a positive int")
    _require(
      isinstance(self.imitation_steps, int) and self.imitation_steps >= 0,
      "imitation_steps",
      self.imitation_steps,
      "an int >= 0 (0: every step)",
    )
    _require(
      self.batch_size % self.mini_batches == 0,
      "mini_batches",
      self.mini_batches,
      f"a divisor of the batch num_groups * group_size = {self.batch_size}",
    )

  @property
  def batch_size(self) -> int:
    return self.num_groups * self.group_size

  @property
  def optimizer_steps(self) -> int:
    """Optimiser steps per rollout batch; with 1, pi_old is the policy being updated."""
    return self.ppo_epochs * self.mini_batches

  def imitating(self, step: int) -> bool:
    """Whether step ``step``'s rollout records the expert labels of the imitation term."""
    within = not self.imitation_steps or step < self.imitation_steps
    return self.loss.imitation_coef > 0 and within

  @property
  def needs_ref_logps(self) -> bool:
    """A KL term against the frozen reference (in the loss, or folded into the reward)."""
    return self.loss.kl_beta > 0 or self.advantage.kl_beta > 0

  @property
  def needs_old_logps(self) -> bool:
    """The reference stage must score the batch under pi_old: several optimiser steps use it, and
    REINFORCE++ folds KL(pi_old || pi_ref) into the reward."""
    kl_in_reward = self.advantage.kl_beta > 0
    return self.optimizer_steps > 1 or kl_in_reward


@dataclasses.dataclass(frozen=True)
class StageLayout:
  """A fixed layout of one stage (used when the selector is off, and as its starting point)."""

  data: int = -1  # data-parallel size; -1 = fill in from the device count
  fsdp: int = 1  # parameter-sharding size
  tensor: int = 1  # tensor-parallel size
  # Sequences at once; 0 = all. Update: per gradient-accumulation micro-batch; reference: per
  # scoring wave; rollout: episodes decoded concurrently (fewer KV-cache rows than num_slots).
  micro_batch_size: int = 0
  remat: str = "none"  # update stage: none | full | dots

  def __post_init__(self):
    for key in ("fsdp", "tensor"):
      _require(getattr(self, key) >= 1, key, getattr(self, key), "a positive int")
    _require(self.data == -1 or self.data >= 1, "data", self.data, "-1 or a positive int")
    _require(self.micro_batch_size >= 0, "micro_batch_size", self.micro_batch_size, "an int >= 0")
    _require(self.remat in ("none", "full", "dots"), "remat", self.remat, "none | full | dots")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  num_devices: int = 0  # devices used by every stage; 0 = all
  selector: bool = False  # True: the selector picks each stage's layout per length bucket
  memory_budget_gib: float = 0.0  # per-device budget; 0 = from device.memory_stats()
  rollout_layout: StageLayout = dataclasses.field(default_factory=StageLayout)
  reference_layout: StageLayout = dataclasses.field(default_factory=StageLayout)
  update_layout: StageLayout = dataclasses.field(default_factory=StageLayout)

  def layout(self, stage_name: str) -> StageLayout:
    """The fixed layout of stage ``rollout`` | ``reference`` | ``update``."""
    return getattr(self, f"{stage_name}_layout")

  def __post_init__(self):
    _require(self.num_devices >= 0, "num_devices", self.num_devices, "an int >= 0 (0 = all)")
    _require(self.memory_budget_gib >= 0, "memory_budget_gib", self.memory_budget_gib, ">= 0")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  num_steps: int = 100  # training steps (one rollout + one update each)
  eval_every: int = 10  # evaluate every N steps (and at the first and last step); 0 = never
  eval_episodes: int = 32  # episodes per opponent per evaluation
  # Episodes per opponent of the last step's evaluation, the run's final figure (more episodes,
  # a tighter reading; the first eval_episodes of them are the curve's); 0 = eval_episodes.
  final_eval_episodes: int = 0
  eval_opponents: tuple[str, ...] = ("random",)  # game opponents to evaluate against (specs:
  # random | first_legal | heuristic | mcts | mcts:N)
  # Scripted policies played against every eval opponent once, at the start of a run: the
  # reference lines of the eval curves (specs: random | column[:N] | stack[:N] | heuristic
  # | mcts:N).
  baselines: tuple[str, ...] = ()
  checkpoint_every: int = 20  # save every N steps (and on SIGTERM and at the end)
  keep_checkpoints: int = 2  # keep the last K checkpoints
  log_every: int = 1  # write metrics every N steps
  # Stop (after saving the last good state) when this many optimiser steps in a row had
  # non-finite gradients and were skipped; each skip is counted in metrics either way.
  max_nonfinite_steps: int = 10
  profile_steps: tuple[int, ...] = ()  # steps traced with jax.profiler into <workdir>/profile

  def __post_init__(self):
    for key in (
      "num_steps",
      "eval_episodes",
      "checkpoint_every",
      "keep_checkpoints",
      "log_every",
      "max_nonfinite_steps",
    ):
      _require(getattr(self, key) >= 1, key, getattr(self, key), "a positive int")
    _require(self.eval_every >= 0, "eval_every", self.eval_every, "an int >= 0 (0 = never)")
    _require(
      self.final_eval_episodes >= 0,
      "final_eval_episodes",
      self.final_eval_episodes,
      "an int >= 0 (0 = eval_episodes)",
    )
    for step in self.profile_steps:
      _require(step >= 0, "profile_steps", self.profile_steps, "a tuple of step numbers >= 0")
    names = [opponents_env.parse_spec(spec, "eval_opponents")[0] for spec in self.eval_opponents]
    _require(
      len(set(names)) == len(names), "eval_opponents", self.eval_opponents, "distinct opponents"
    )
    for spec in self.baselines:
      baselines_env.parse_spec(spec, "baselines")
    _require(
      len(set(self.baselines)) == len(self.baselines), "baselines", self.baselines, "distinct"
    )


# ----------------------------------------------------------------------------------------------
# Experiment

# Half the spacing of bfloat16 numbers at |w| = 0.02, a typical LLM weight: an Adam step (about the
# learning rate per parameter) below this rounds back to w, so the weight never moves.
_BF16_HALF_ULP_AT_0_02 = 2.0**-6 * 2.0**-8


def _warn_pure_bf16(model: ModelConfig, optim: OptimConfig) -> None:
  if model.param_dtype is DType.BFLOAT16 and optim.learning_rate < 2 * _BF16_HALF_ULP_AT_0_02:
    warnings.warn(
      f"model.param_dtype='bfloat16' keeps the master weights in bf16, where an update below "
      f"~{_BF16_HALF_ULP_AT_0_02:.1e} rounds away for |w| = 0.02: optim.learning_rate="
      f"{optim.learning_rate:g} will leave most weights unchanged. Use param_dtype='float32' "
      f"(compute_dtype='bfloat16' keeps bf16 matmuls).",
      stacklevel=3,
    )


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything a run needs. Each section is validated on its own, then their combination."""

  seed: int = 0
  pretrained_path: str = ""  # HF directory or repo id; when set, model is read from its config.json
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
  env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
  sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  rl: RLConfig = dataclasses.field(default_factory=RLConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

  def __post_init__(self):
    _require(self.seed >= 0, "seed", self.seed, "a non-negative int")
    mini = self.rl.batch_size // self.rl.mini_batches
    micro = self.parallel.update_layout.micro_batch_size
    _require(
      micro == 0 or mini % micro == 0,
      "parallel.update_layout.micro_batch_size",
      micro,
      f"0 or a divisor of the mini-batch rl.num_groups * rl.group_size / rl.mini_batches = {mini}",
    )
    for key, what, whole in (
      ("rollout_layout", "rollout.num_slots", self.rollout.num_slots),
      ("reference_layout", "the batch rl.num_groups * rl.group_size", self.rl.batch_size),
    ):
      micro = getattr(self.parallel, key).micro_batch_size
      _require(
        micro == 0 or whole % micro == 0,
        f"parallel.{key}.micro_batch_size",
        micro,
        f"0 or a divisor of {what} = {whole}",
      )
    _warn_pure_bf16(self.model, self.optim)
    if self.tokenizer.kind == TokenizerKind.HF and not self.tokenizer.path:
      # The tokenizer follows the checkpoint unless set on its own.
      _require(
        bool(self.pretrained_path),
        "tokenizer.path",
        self.tokenizer.path,
        "a directory or hub repo id when tokenizer.kind='hf' (empty: pretrained_path's, "
        "which is unset)",
      )
      tokenizer = dataclasses.replace(self.tokenizer, path=self.pretrained_path)
      object.__setattr__(self, "tokenizer", tokenizer)
    _require(
      not self.train.baselines or self.env.name != env_registry.CALCULATOR,
      "train.baselines",
      self.train.baselines,
      "() with env.name 'calculator' (baselines are scripted game players)",
    )
    if self.sampler.restrict_answers:
      _require(
        self.env.name != env_registry.CALCULATOR,
        "sampler.restrict_answers",
        True,
        "False with env.name 'calculator' (its answers are free text, not one token)",
      )
      _require(
        self.env.game.parse_mode is parsing_env.ParseMode.LENIENT,
        "env.game.parse_mode",
        self.env.game.parse_mode.value,
        "'lenient' with sampler.restrict_answers (the answer is the bare move, one token)",
      )
      _require(
        self.rollout.max_new_tokens == 1,
        "rollout.max_new_tokens",
        self.rollout.max_new_tokens,
        "1 with sampler.restrict_answers (each answer is exactly one token)",
      )
    if self.rl.loss.imitation_coef > 0:
      _require(
        self.sampler.restrict_answers and self.rollout.batching == "turn",
        "rl.loss.imitation_coef",
        self.rl.loss.imitation_coef,
        "0 unless sampler.restrict_answers=True and rollout.batching='turn' (the expert labels "
        "answers of the env's alphabet, turn by turn)",
      )
    if self.sampler.legal_answers:
      _require(
        self.rollout.batching == "turn",
        "rollout.batching",
        self.rollout.batching,
        "'turn' with sampler.legal_answers (continuous batching has no per-turn answer masks)",
      )
    _require(
      self.rollout.max_context <= self.model.max_seq_len,
      "rollout.max_context",
      self.rollout.max_context,
      f"<= model.max_seq_len ({self.model.max_seq_len})",
    )
    _require(
      self.rl.logp_chunk <= self.rollout.seq_multiple
      and self.rollout.seq_multiple % self.rl.logp_chunk == 0,
      "rl.logp_chunk",
      self.rl.logp_chunk,
      f"a divisor of rollout.seq_multiple ({self.rollout.seq_multiple}), the padding unit",
    )
    remat = self.parallel.update_layout.remat
    _require(
      self.model.forward_layers != "unrolled" or remat == "none" or self.parallel.selector,
      "model.forward_layers",
      self.model.forward_layers,
      f"scan or auto with parallel.update_layout.remat={remat!r} (a rematerialised forward "
      "always scans: unrolled, XLA keeps no remat boundary)",
    )


# ----------------------------------------------------------------------------------------------
# ConfigDict -> dataclasses

T = TypeVar("T")


def from_config_dict(config: ml_collections.ConfigDict | Mapping[str, Any]) -> ExperimentConfig:
  """Converts a config (as built by ``configs/*.py``) into a validated ``ExperimentConfig``."""
  return build(ExperimentConfig, config)


def build(cls: type[T], values: Mapping[str, Any] | ml_collections.ConfigDict, path: str = "") -> T:
  """Builds dataclass ``cls`` from a mapping or ConfigDict (``config_build.build``)."""
  if isinstance(values, ml_collections.ConfigDict):
    values = values.to_dict()
  return config_build.build(cls, values, path)


class ConfigFileError(ConfigError):
  """A config file that gives no config; ``problem`` says why in one line."""

  def __init__(self, path: str, problem: str):
    super().__init__("config", path, f"a file whose get_config() returns a ConfigDict: {problem}")
    self.problem = problem


def read_config_file(path: str) -> ml_collections.ConfigDict:
  """The ConfigDict a ``configs/*.py`` file's ``get_config()`` returns, unvalidated. The file's
  repository is importable meanwhile (``from configs import base``). A missing, broken or wrong
  file is a ConfigFileError naming the file and the first problem."""
  if not os.path.isfile(path):
    raise ConfigFileError(path, f"no config file at {path!r}")
  spec = importlib.util.spec_from_file_location("_earl_config_file", path)
  if spec is None or spec.loader is None:
    raise ConfigFileError(path, f"{path!r} is not a Python file")
  module = importlib.util.module_from_spec(spec)
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  sys.path.insert(0, root)
  try:
    try:
      spec.loader.exec_module(module)
    except Exception as e:  # a broken file: name it and the first problem
      raise ConfigFileError(path, f"{path} cannot be imported: {type(e).__name__}: {e}") from None
    if not callable(getattr(module, "get_config", None)):
      why = "defines no get_config() (it must return an ml_collections.ConfigDict)"
      raise ConfigFileError(path, f"{path} {why}")
    try:
      config = module.get_config()
    except Exception as e:
      raise ConfigFileError(path, f"{path}: get_config() raised {type(e).__name__}: {e}") from None
  finally:
    sys.path.remove(root)
  if not hasattr(config, "keys"):
    kind = type(config).__name__
    raise ConfigFileError(path, f"{path}: get_config() returned a {kind}, not a ConfigDict")
  return config


def load_config_file(path: str, overrides: Sequence[str] = ()) -> ExperimentConfig:
  """The validated config of a ``configs/*.py`` file with ``overrides`` (``"rl.num_groups=4"``:
  Python literals, or the text as a string) applied; a bad file or an unknown key is a
  ConfigError naming it. For tools; ``launch/train.py`` reads the file the same way and parses
  overrides with ml_collections' config flags."""
  config = read_config_file(path)
  values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise ConfigError(key, None, "an override written key=value")
    *parents, leaf = key.split(".")
    node = values
    for i, part in enumerate([*parents, leaf]):
      if not isinstance(node, dict) or part not in node:
        known = sorted(node) if isinstance(node, dict) else []
        where = ".".join(parents[:i]) or "<root>"
        raise ConfigError(key, text, f"a known key; the keys under {where}: {known}")
      if i < len(parents):
        node = node[part]
    node[leaf] = _literal(text)
  return from_config_dict(values)


def _literal(text: str) -> Any:
  lowered = text.strip().lower()
  if lowered in ("true", "false"):
    return lowered == "true"
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


# Keys a resumed run may change without changing the experiment: its length, cadences, where files
# are read from, and how the work is laid out on the devices (a checkpoint restores onto any
# layout) and looped over the layers (model.scan_layers: the key forward_layers replaced). Every
# other key (model, optimiser, RL, environment, sampler, rollout, seed) defines the experiment,
# and changing one on resume needs --allow_config_change.
RUN_ONLY_KEYS: tuple[str, ...] = (
  "train.num_steps",
  "train.eval_every",
  "train.eval_episodes",
  "train.final_eval_episodes",
  "train.eval_opponents",
  "train.baselines",
  "train.checkpoint_every",
  "train.keep_checkpoints",
  "train.log_every",
  "train.max_nonfinite_steps",
  "train.profile_steps",
  "pretrained_path",
  "tokenizer.path",
  "parallel",
  "model.forward_layers",
  "model.decode_layers",
  "model.scan_layers",
)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out: dict[str, Any] = {}
    for key, value in tree.items():
      out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out
  return {prefix: list(tree) if isinstance(tree, tuple | list) else tree}


class ConfigChangedError(ConfigError):
  """A resume whose config changes the experiment saved in the checkpoint."""

  def __init__(self, step: int, directory: Any, changes: list[str]):
    self.step, self.changes = step, changes
    ValueError.__init__(
      self,
      f"the config differs from the one checkpoint step {step} in {directory} was trained with: "
      + "; ".join(changes)
      + ". Restore those values, use another workdir, or pass --allow_config_change",
    )
    self.key, self.value, self.allowed = changes[0].split(":")[0], None, "the saved value"


def config_changes(saved: Mapping[str, Any], new: ExperimentConfig) -> tuple[list[str], list[str]]:
  """The differences of a run's saved config (``to_dict`` form, e.g. read back from JSON) and
  ``new``, as ``(experiment_changes, run_only_changes)``, each a list of "key: old -> new".

  A key the saved config lacks (written before the key existed) counts as its default value.
  """
  before = _flat(to_dict(ExperimentConfig())) | _flat(saved)
  after = _flat(to_dict(new))
  experiment, run_only = [], []
  for key in sorted(set(before) | set(after)):
    old, value = before.get(key, "<absent>"), after.get(key, "<absent>")
    if old == value:
      continue
    line = f"{key}: {old!r} -> {value!r}"
    is_run_only = any(key == k or key.startswith(k + ".") for k in RUN_ONLY_KEYS)
    (run_only if is_run_only else experiment).append(line)
  return experiment, run_only
