"""The Colab notebook runs as shipped (its code cells, in order, in a fresh Python), in the smoke
mode CI uses: 2 training steps, from the clone it sits in, files under colab/runs/."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "colab" / "connect_four_tiny.ipynb"


def _code_cells() -> list[str]:
  cells = json.loads(NOTEBOOK.read_text())["cells"]
  return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def test_notebook_has_no_shell_magic_or_placeholders():
  for source in _code_cells():
    assert not any(line.lstrip().startswith(("!", "%")) for line in source.splitlines()), source
    assert "<your" not in source and "/content/" not in source, source


@pytest.mark.slow
def test_notebook_runs_in_smoke_mode(tmp_path):
  shutil.rmtree(REPO / "colab" / "runs" / "smoke", ignore_errors=True)
  script = tmp_path / "notebook.py"
  script.write_text("\n\n".join(_code_cells()))
  env = dict(os.environ, EARL_JAX_NOTEBOOK_SMOKE="1", MPLBACKEND="Agg", JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  done = subprocess.run(
    [sys.executable, str(script)],
    cwd=REPO / "colab",
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  assert "baselines: win rate over 32 eval episodes" in done.stdout, done.stdout[-2000:]
  rows = (REPO / "colab" / "runs" / "smoke" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [0, 1]
  shutil.rmtree(REPO / "colab" / "runs" / "smoke", ignore_errors=True)
