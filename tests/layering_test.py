"""Import rules of DESIGN.md, checked on the source: the data flow stays one-way.

- Stages (sampler, rl.reference, rl.advantage, rl.losses, rl.update, rl.rollout) never import each
  other's modules beyond the batch contracts, nor the dispatcher or the loop.
- Model code never imports the parallel layer (it names logical axes only).
- Only config_lib imports ml_collections inside the library.
"""

import ast
import pathlib

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
