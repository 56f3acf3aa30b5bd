"""Import rules of DESIGN.md, checked on the source: the data flow stays one-way.

- Stages (sampler, rl.reference, rl.advantage, rl.losses, rl.update, rl.rollout) never import each
  other's modules beyond the batch contracts, nor the dispatcher or the loop.
- Model code never imports the parallel layer (it names logical axes only).
- Only config_lib imports ml_collections inside the library.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "earl_jax"


def _imports(path: pathlib.Path) -> set[str]:
  tree = ast.parse(path.read_text())
  names: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


def _modules(subdir: str) -> list[pathlib.Path]:
  return sorted((PKG / subdir).glob("*.py")) if (PKG / subdir).is_dir() else []


STAGES = {
  "earl_jax.rl.reference",
  "earl_jax.rl.advantage",
  "earl_jax.rl.losses",
  "earl_jax.rl.update",
  "earl_jax.rl.rollout",
  "earl_jax.sampler.engine",
}
FORBIDDEN_FOR_STAGES = {"earl_jax.parallel.dispatcher", "earl_jax.rl.loop"}


def _name(path: pathlib.Path) -> str:
  return "earl_jax." + ".".join(path.relative_to(PKG).with_suffix("").parts)


@pytest.mark.parametrize("path", [p for d in ("rl", "sampler") for p in _modules(d)], ids=_name)
def test_stages_do_not_import_each_other(path: pathlib.Path):
  me = _name(path)
  if me not in STAGES:
    return
  imported = _imports(path)
  bad = sorted(n for n in imported if n in (STAGES - {me}) or n in FORBIDDEN_FOR_STAGES)
  # The rollout stage drives the sampler engine through an injected callable, not an import.
  assert not bad, f"{me} imports {bad}"


@pytest.mark.parametrize("path", _modules("model"), ids=_name)
def test_model_never_imports_parallel(path: pathlib.Path):
  assert not [n for n in _imports(path) if n.startswith("earl_jax.parallel")]


def test_only_config_lib_imports_ml_collections():
  offenders = [
    _name(p)
    for p in PKG.rglob("*.py")
    if p.name != "config_lib.py" and any(n.startswith("ml_collections") for n in _imports(p))
  ]
  assert not offenders


# ------------------------------------------------------------------------------------------------
# Transitive rules: what a fresh interpreter has loaded after importing one module.

_PARALLEL = sorted(_name(p) for p in _modules("parallel") if p.stem != "__init__")
_ROOTS = ["earl_jax.model", *_PARALLEL, *sorted(STAGES)]
_PROBE = (
  "import importlib, json, sys; importlib.import_module(sys.argv[1]); "
  "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('earl_jax', 'pyspiel')))))"
)


def _forbidden(root: str) -> tuple[str, ...]:
  if root == "earl_jax.model":  # the model knows nothing of envs, RL, layouts or experiments
    return ("earl_jax.env", "earl_jax.rl", "earl_jax.parallel", "earl_jax.config_lib", "pyspiel")
  if root.startswith("earl_jax.parallel"):  # stage programs come in as functions
    return ("earl_jax.rl", "earl_jax.env", "earl_jax.config_lib", "pyspiel")
  # A stage: no other stage, dispatcher or loop; of the environments only their protocol.
  others = tuple(sorted(STAGES - {root}))
  envs = tuple(
    f"earl_jax.env.{p.stem}" for p in _modules("env") if p.stem not in ("__init__", "base")
  )
  return (*others, *sorted(FORBIDDEN_FOR_STAGES), *envs, "earl_jax.config_lib", "pyspiel")


def test_imports_hold_transitively_in_a_fresh_interpreter():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  procs = {
    root: subprocess.Popen(
      [sys.executable, "-c", _PROBE, root],
      stdout=subprocess.PIPE,
      text=True,
      env=env,
      cwd=PKG.parent,
    )
    for root in _ROOTS
  }
  bad = {}
  for root, proc in procs.items():
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, root
    loaded = json.loads(out.strip().splitlines()[-1])
    forbidden = _forbidden(root)
    wrong = [m for m in loaded if m in forbidden or m.startswith(tuple(f"{f}." for f in forbidden))]
    if wrong:
      bad[root] = wrong
  assert not bad, bad


def test_training_never_loads_jetstream_or_tensorflow():
  """Serving is an extra: the trainer runs on the main install (JetStream pulls tensorflow)."""
  probe = (
    "import sys, earl_jax.rl.loop, earl_jax.sampler.slots; "
    "print(sorted({m.split('.')[0] for m in sys.modules} & {'jetstream', 'tensorflow', 'seqio'}))"
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       cwd=PKG.parent, timeout=300)  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"
