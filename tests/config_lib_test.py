"""Config system: every config file loads and validates; bad values fail with a named key."""

import dataclasses
import importlib
import json
import pathlib
import subprocess
import sys

import ml_collections
import pytest

from earl_jax import config_lib

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG_FILES = sorted(p.stem for p in (REPO / "configs").glob("*.py") if p.stem != "__init__")


def _load(name: str) -> ml_collections.ConfigDict:
  sys.path.insert(0, str(REPO))
  try:
    return importlib.import_module(f"configs.{name}").get_config()
  finally:
    sys.path.remove(str(REPO))


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_file_loads_and_validates(name: str):
  cfg = _load(name)
  exp = config_lib.from_config_dict(cfg)
  assert isinstance(exp, config_lib.ExperimentConfig)
  # The dataclass round-trips to the same dict the file produced (an empty hf tokenizer path
  # resolved to the checkpoint's).
  expected = cfg.to_dict()
  if expected["tokenizer"]["kind"] == "hf" and not expected["tokenizer"]["path"]:
    expected["tokenizer"]["path"] = expected["pretrained_path"]
  assert config_lib.to_dict(exp) == expected


def test_an_observation_the_game_cannot_render_fails_at_validation():
  c = _load("tic_tac_toe_tiny")
  c.env.game.observation = "columns"  # Connect Four only
  with pytest.raises(config_lib.ConfigError, match=r"'env\.game\.observation' has value 'columns'"):
    config_lib.from_config_dict(c)


def test_base_defaults_equal_dataclass_defaults():
  # configs/base.py is the single place users read defaults; the dataclasses must agree with it.
  assert config_lib.to_dict(config_lib.ExperimentConfig()) == _load("base").to_dict()


def test_derived_configs_declare_no_new_keys():
  base_keys = set(_flat(_load("base").to_dict()))
  for name in CONFIG_FILES:
    assert set(_flat(_load(name).to_dict())) <= base_keys, name


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@pytest.mark.parametrize(
  ("path", "value", "fragment"),
  [
    ("model.num_kv_heads", 3, "divisor of num_heads=4"),
    ("model.num_layers", -1, "positive int"),
    ("model.head_dim", 7, "even"),
    ("model.param_dtype", "float16", "one of ['float32', 'bfloat16']"),
    ("model.num_layers", 2.5, "an int"),
    ("model.qkv_bias", 1, "True or False"),
    ("model.rope.type", "yarn", "one of ['default', 'llama3']"),
    ("model.rope.theta", 0.0, "positive"),
    ("tokenizer.kind", "sentencepiece", "one of ['char', 'hf']"),
    ("seed", -3, "non-negative"),
    ("parallel.update_layout.micro_batch_size", 3, "divisor of the mini-batch"),
    ("parallel.reference_layout.micro_batch_size", 3, "divisor of the batch"),
    ("parallel.rollout_layout.micro_batch_size", 3, "divisor of rollout.num_slots"),
    ("train.final_eval_episodes", -1, "an int >= 0 (0 = eval_episodes)"),
  ],
)
def test_bad_values_name_key_value_and_rule(path: str, value, fragment: str):
  d = _load("base").to_dict()
  node = d
  *parents, leaf = path.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.from_config_dict(d)
  assert err.value.key == path
  assert repr(value) in str(err.value) and fragment in str(err.value)


def test_unknown_key_is_rejected_with_known_keys_listed():
  d = _load("base").to_dict()
  d["model"]["num_layer"] = 3
  with pytest.raises(config_lib.ConfigError, match=r"model\.num_layer.*known keys"):
    config_lib.from_config_dict(d)


def test_hf_tokenizer_needs_a_path():
  with pytest.raises(config_lib.ConfigError, match=r"tokenizer\.path.*pretrained_path"):
    config_lib.build(config_lib.ExperimentConfig, {"tokenizer": {"kind": "hf"}})


def test_hf_tokenizer_follows_pretrained_path_unless_set():
  # Overriding only pretrained_path (e.g. to a local copy) must not keep the hub tokenizer id.
  d = _load("connect_four_qwen2_5_0_5b").to_dict()
  d["pretrained_path"] = "/data/qwen-0.5b"
  assert config_lib.from_config_dict(d).tokenizer.path == "/data/qwen-0.5b"
  d["tokenizer"]["path"] = "/data/tok"
  assert config_lib.from_config_dict(d).tokenizer.path == "/data/tok"


def test_configs_are_frozen():
  exp = config_lib.ExperimentConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    exp.model.num_layers = 3  # type: ignore[misc]


def test_padded_vocab():
  assert config_lib.ModelConfig(vocab_size=130, vocab_multiple=128).padded_vocab_size == 256
  assert config_lib.ModelConfig(vocab_size=128, vocab_multiple=128).padded_vocab_size == 128


def _train(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, str(REPO / "launch" / "train.py"), *args],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
  )


def test_launch_rejects_unknown_override_before_compute():
  proc = _train("--config.model.num_layerz=3")
  assert proc.returncode != 0
  assert "unknown config key 'num_layerz' under 'model'" in proc.stderr


def test_launch_rejects_impossible_value():
  proc = _train("--config.model.num_kv_heads=3")
  assert proc.returncode != 0
  assert "model.num_kv_heads" in proc.stderr and "divisor of num_heads" in proc.stderr


def test_non_finite_floats_are_rejected_with_their_key():
  for value in (float("inf"), float("-inf"), float("nan")):
    with pytest.raises(config_lib.ConfigError, match=r"'sampler.temperature' .* a finite float"):
      config_lib.from_config_dict({"sampler": {"temperature": value}})


def test_sampler_errors_name_the_config_key():
  with pytest.raises(config_lib.ConfigError, match=r"'sampler.top_p' has value 2.0"):
    config_lib.from_config_dict({"sampler": {"strategy": "top_p", "top_p": 2.0}})
  with pytest.raises(config_lib.ConfigError, match=r"'sampler.top_k' has value 0"):
    config_lib.from_config_dict({"sampler": {"strategy": "top_k", "top_k": 0}})


_RESTRICTED = {
  "sampler": {"restrict_answers": True},
  "rollout": {"max_new_tokens": 1},
  "env": {"game": {"parse_mode": "lenient"}},
}


def _assert_config_error(values: dict, key: str, fragment: str) -> None:
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.from_config_dict(values)
  assert err.value.key == key and fragment in str(err.value)


def _merged(base: dict, extra: dict) -> dict:
  out = dict(base)
  for k, v in extra.items():
    out[k] = _merged(out.get(k, {}), v) if isinstance(v, dict) else v
  return out


@pytest.mark.parametrize(
  ("extra", "key", "fragment"),
  [
    ({"env": {"name": "calculator"}}, "sampler.restrict_answers", "env.name 'calculator'"),
    ({"env": {"game": {"parse_mode": "tag"}}}, "env.game.parse_mode", "'lenient' with sampler"),
    ({"rollout": {"max_new_tokens": 2}}, "rollout.max_new_tokens", "1 with sampler"),
  ],
)
def test_restricted_answers_need_bare_one_token_moves(extra, key, fragment):
  assert config_lib.from_config_dict(_RESTRICTED).sampler.restrict_answers
  _assert_config_error(_merged(_RESTRICTED, extra), key, fragment)


@pytest.mark.parametrize(
  ("extra", "key", "fragment"),
  [
    ({"sampler": {"restrict_answers": False}}, "sampler.legal_answers", "without restrict"),
    ({"rollout": {"batching": "continuous"}}, "rollout.batching", "'turn' with sampler.legal"),
  ],
)
def test_legal_answers_need_restricted_answers_and_turn_batching(extra, key, fragment):
  legal = _merged(_RESTRICTED, {"sampler": {"legal_answers": True}})
  assert config_lib.from_config_dict(legal).sampler.make(answer_ids=(4, 5)).per_row
  _assert_config_error(_merged(legal, extra), key, fragment)


@pytest.mark.parametrize(
  ("extra", "key", "fragment"),
  [
    ({"sampler": {"restrict_answers": False}}, "rl.loss.imitation_coef", "restrict_answers=True"),
    ({"rollout": {"batching": "continuous"}}, "rl.loss.imitation_coef", "batching='turn'"),
    ({"rl": {"imitation_steps": -1}}, "rl.imitation_steps", "an int >= 0"),
    ({"rl": {"loss": {"imitation_coef": -0.1}}}, "rl.loss.imitation_coef", "non-negative"),
  ],
)
def test_imitation_needs_restricted_answers_turn_batching_and_sane_values(extra, key, fragment):
  imitating = _merged(_RESTRICTED, {"rl": {"loss": {"imitation_coef": 0.5}}})
  cfg = config_lib.from_config_dict(_merged(imitating, {"rl": {"imitation_steps": 2}}))
  assert [cfg.rl.imitating(step) for step in range(3)] == [True, True, False]
  assert config_lib.from_config_dict(imitating).rl.imitating(10**6)  # 0: every step
  assert not config_lib.from_config_dict(_RESTRICTED).rl.imitating(0)  # coef 0: never
  _assert_config_error(_merged(imitating, extra), key, fragment)


@pytest.mark.parametrize(
  ("option", "key", "message"),
  [
    ({"sampler": {"legal_answers": True}}, "sampler.legal_answers", "does not say which are legal"),
    ({"rl": {"loss": {"imitation_coef": 1.0}}}, "rl.loss.imitation_coef", "no scripted expert"),
  ],
)
def test_legal_answers_and_imitation_need_an_env_that_knows_them(monkeypatch, option, key, message):
  """Legal moves need an env that names them; the imitation term an env with a scripted expert."""
  from earl_jax import model as model_lib
  from earl_jax.rl import preflight

  cfg = config_lib.from_config_dict(_merged(_RESTRICTED, option))
  tok = model_lib.CharTokenizer()
  assert len(preflight.answer_token_ids(cfg, tok)) == 7

  class AlphabetOnly:
    answer_alphabet = tuple("0123")

  monkeypatch.setattr(config_lib.EnvConfig, "make", lambda self, **kw: AlphabetOnly())
  with pytest.raises(config_lib.ConfigError, match=message) as err:
    preflight.answer_token_ids(cfg, tok)
  assert err.value.key == key


def test_restricted_answers_are_the_move_token_ids(monkeypatch):
  from earl_jax import model as model_lib
  from earl_jax.rl import preflight

  cfg = config_lib.from_config_dict(_RESTRICTED)
  tok = model_lib.CharTokenizer()
  ids = preflight.answer_token_ids(cfg, tok)
  assert [tok.decode([i]) for i in ids] == list("0123456")  # Connect Four's seven columns
  free = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, restrict_answers=False))
  assert preflight.answer_token_ids(free, tok) == ()

  class TenMoves:
    answer_alphabet = tuple(str(i) for i in range(11))

  monkeypatch.setattr(config_lib.EnvConfig, "make", lambda self, **kw: TenMoves())
  with pytest.raises(config_lib.ConfigError, match=r"answer '10' is 2 tokens") as err:
    preflight.answer_token_ids(cfg, tok)
  assert err.value.key == "sampler.restrict_answers"


def test_config_changes_split_experiment_from_run_only_keys():
  base = config_lib.ExperimentConfig()
  saved = json.loads(json.dumps(config_lib.to_dict(base)))  # as read back from a checkpoint
  assert config_lib.config_changes(saved, base) == ([], [])
  new = config_lib.from_config_dict(
    {
      "seed": 3,
      "optim": {"learning_rate": 1e-4},
      "train": {"num_steps": 7, "eval_opponents": ("random", "mcts")},
      "parallel": {"update_layout": {"fsdp": 2}},
    }
  )
  experiment, run_only = config_lib.config_changes(saved, new)
  assert experiment == ["optim.learning_rate: 1e-05 -> 0.0001", "seed: 0 -> 3"]
  assert run_only == [
    "parallel.update_layout.fsdp: 1 -> 2",
    "train.eval_opponents: ['random'] -> ['random', 'mcts']",
    "train.num_steps: 100 -> 7",
  ]
  # A checkpoint written before a key existed: the key counts as its default.
  older = {k: v for k, v in saved.items() if k != "seed"}
  assert config_lib.config_changes(older, base) == ([], [])


def test_layer_loops_are_run_only_and_the_replaced_scan_layers_key_resumes():
  """How the layers are looped changes the program, not the experiment; a checkpoint written
  while the key was ``model.scan_layers`` (a bool) resumes under ``model.forward_layers``."""
  base = config_lib.ExperimentConfig()
  saved = json.loads(json.dumps(config_lib.to_dict(base)))
  saved["model"].pop("forward_layers")
  saved["model"]["scan_layers"] = True
  new = config_lib.from_config_dict({"model": {"forward_layers": "scan", "decode_layers": "scan"}})
  experiment, run_only = config_lib.config_changes(saved, new)
  assert experiment == []
  assert run_only == [
    "model.decode_layers: 'auto' -> 'scan'",
    "model.forward_layers: 'auto' -> 'scan'",
    "model.scan_layers: True -> '<absent>'",
  ]
  with pytest.raises(config_lib.ConfigError, match="forward_layers"):
    config_lib.from_config_dict({"model": {"forward_layers": "loop"}})


def test_unrolled_forward_with_remat_is_refused_not_silently_scanned():
  with pytest.raises(config_lib.ConfigError, match="scan or auto with") as err:
    config_lib.from_config_dict(
      {"model": {"forward_layers": "unrolled"}, "parallel": {"update_layout": {"remat": "full"}}}
    )
  assert err.value.key == "model.forward_layers"
  ok = {"model": {"forward_layers": "auto"}, "parallel": {"update_layout": {"remat": "full"}}}
  assert config_lib.from_config_dict(ok).model.forward_layers == "auto"
