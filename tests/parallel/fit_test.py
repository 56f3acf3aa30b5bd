"""The pod fit check: stage programs compiled from abstract shapes, predicted vs compiled peaks."""

from __future__ import annotations

import pathlib

import jax
import pytest

from earl_jax import config_lib, fit
from earl_jax.parallel import fit as fit_cli
from earl_jax.rl import preflight
from earl_jax.types import Stage

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "connect_four_tiny.py")


def test_cli_prints_a_row_per_stage_and_context_and_exits_by_fit(capsys):
  args = ["--config", TINY, "--devices", "8", "--context", "128,256"]
  assert fit_cli.main([*args, "--device-memory", "1GiB"]) == 0
  out = capsys.readouterr().out
  rows = [line.split() for line in out.splitlines() if line.strip()[:3].isdigit()]
  assert [(r[0], r[1]) for r in rows] == [(t, s.value) for t in ("128", "256") for s in Stage]
  assert all(r[-2] == "yes" for r in rows), out
  # A budget below the weights: nothing fits, each stage says so, and the exit status is 1.
  assert fit_cli.main([*args[:-2], "--context", "128", "--device-memory", "64KiB"]) == 1
  out = capsys.readouterr().out
  assert out.count("no plan fits") == 3, out


@pytest.mark.parametrize(
  "extra, fragment",
  [
    (["--context", "100000"], "--config.rollout.max_context=100000"),
    (["--context", "2k"], "token counts"),
    (["--context", "128", "--config.rl.num_group=3"], "rl.num_group"),
    (["--context", "128", "--devices", "64"], "at most the 8 CPU devices"),
  ],
)
def test_bad_input_is_one_line_before_any_compile(capsys, extra, fragment):
  base = ["--config", TINY, "--devices", "8", "--device-memory", "1GiB"]
  assert fit_cli.main(base + extra) == 2
  err = capsys.readouterr().err.strip()
  assert fragment in err and "\n" not in err, err


def test_hub_ids_resolve_to_presets_with_the_configs_run_time_keys():
  cfg = config_lib.load_config_file(str(REPO / "configs" / "connect_four_qwen2_5_7b.py"))
  model = fit.for_accelerators(fit.model_config(cfg))
  assert (model.embed_dim, model.num_layers, model.num_kv_heads) == (3584, 28, 4)
  assert model.param_dtype.value == "float32" and model.compute_dtype.value == "bfloat16"
  # What an accelerator runs, not the CPU's unrolled loops.
  assert model.decode_layers == model.forward_layers == "scan"


@pytest.mark.slow
def test_shipped_0_5b_layouts_compile_and_the_model_predicts_their_peaks():
  """Qwen2.5-0.5B at its shipped settings (float32 master weights, bf16 compute, remat, the
  config's fixed layouts) at 1K context on 8 devices, nothing allocated: the analytic model is
  within 15% of XLA's compiled peak for every stage."""
  cfg = config_lib.load_config_file(str(REPO / "configs" / "connect_four_qwen2_5_0_5b.py"))
  model = fit.for_accelerators(fit.model_config(cfg))
  check = fit.FitCheck(cfg, model, jax.devices()[:8], 80 * 2**30)
  assert 490e6 < check.num_params < 500e6  # Qwen2.5-0.5B, vocabulary padded
  plans = preflight.make_plans(cfg, check.devices, model)
  for stage in Stage:
    row = check.check(stage, 1024, plans[stage])
    assert row.fits and row.compiled_bytes > 0, row
    assert -0.15 <= row.error <= 0.15, row
