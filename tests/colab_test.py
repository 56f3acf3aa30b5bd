"""The Colab notebooks run as shipped (their code cells, in order, in a fresh Python), in the smoke
mode CI uses: 2 training steps, from the clone they sit in, files under colab/runs/. The Qwen
notebook runs on a tiny Qwen2 checkpoint and tokenizer made here: no hub access."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "colab" / "connect_four_tiny.ipynb"
QWEN_NOTEBOOK = REPO / "colab" / "connect_four_qwen2_5_0_5b.ipynb"


def _code_cells(notebook: pathlib.Path = NOTEBOOK) -> list[str]:
  cells = json.loads(notebook.read_text())["cells"]
  return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


@pytest.mark.parametrize("notebook", [NOTEBOOK, QWEN_NOTEBOOK], ids=lambda p: p.stem)
def test_notebook_has_no_shell_magic_or_placeholders(notebook):
  for source in _code_cells(notebook):
    assert not any(line.lstrip().startswith(("!", "%")) for line in source.splitlines()), source
    assert "<your" not in source and "/content/" not in source, source


def _run_notebook(notebook: pathlib.Path, tmp_path: pathlib.Path, **env_vars: str):
  script = tmp_path / "notebook.py"
  script.write_text("\n\n".join(_code_cells(notebook)))
  env = dict(os.environ, EARL_JAX_NOTEBOOK_SMOKE="1", MPLBACKEND="Agg", JAX_PLATFORMS="cpu")
  # The device count the notebook sets for itself (the tests' 8 simulated devices stay here).
  env.pop("XLA_FLAGS", None)
  return subprocess.run(
    [sys.executable, str(script)],
    cwd=REPO / "colab",
    env={**env, **env_vars},
    capture_output=True,
    text=True,
    timeout=900,
  )


@pytest.mark.slow
def test_notebook_runs_in_smoke_mode(tmp_path):
  shutil.rmtree(REPO / "colab" / "runs" / "smoke", ignore_errors=True)
  done = _run_notebook(NOTEBOOK, tmp_path)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  assert "baselines: win rate over 32 eval episodes" in done.stdout, done.stdout[-2000:]
  rows = (REPO / "colab" / "runs" / "smoke" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [0, 1]
  shutil.rmtree(REPO / "colab" / "runs" / "smoke", ignore_errors=True)


def _tiny_qwen_checkpoint(directory: pathlib.Path) -> str:
  """A random 2-layer Qwen2 with a byte-level BPE tokenizer (Qwen's special tokens and chat
  format), written with transformers as a hub checkpoint is."""
  import random

  import torch
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  words = ["Connect", "Four", "You", "play", "column", "<move>", "</move>", "X", "O", ".", "3"]
  rng = random.Random(0)
  corpus = [" ".join(rng.choice(words) for _ in range(10)) for _ in range(200)]
  trainer = trainers.BpeTrainer(
    vocab_size=400,
    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(corpus, trainer=trainer)
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
  )
  fast.chat_template = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
  )
  fast.save_pretrained(directory)
  config = transformers.Qwen2Config(
    vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    tie_word_embeddings=True, eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
  )  # fmt: skip
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
  return str(directory)


@pytest.mark.slow
def test_qwen_notebook_runs_in_tiny_mode_and_prints_a_game(tmp_path):
  shutil.rmtree(REPO / "colab" / "runs" / "qwen_smoke", ignore_errors=True)
  checkpoint = _tiny_qwen_checkpoint(tmp_path / "qwen_tiny")
  done = _run_notebook(QWEN_NOTEBOOK, tmp_path, EARL_JAX_NOTEBOOK_CHECKPOINT=checkpoint)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  assert f"checkpoint: {checkpoint}" in done.stdout
  rows = (REPO / "colab" / "runs" / "qwen_smoke" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [0, 1]
  assert "eval/mcts/win_rate" in json.loads(rows[-1])
  # The closing game: an empty 6x7 board, a board after every policy turn, then the outcome.
  game = done.stdout[done.stdout.index("\n" + "." * 7 + "\n") :]
  assert game.count("policy: ") >= 1 and "\noutcome: " in game, game[-1500:]
  assert game.count("\n" + "." * 7 + "\n") >= 1
  shutil.rmtree(REPO / "colab" / "runs" / "qwen_smoke", ignore_errors=True)
