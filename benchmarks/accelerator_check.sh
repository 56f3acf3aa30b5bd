#!/usr/bin/env bash
# The checks that need an accelerator, in one run (GPU or TPU; about 10 minutes on one H100):
#   1. the devices and versions;
#   2. the tests whose code paths differ on an accelerator (attention kernels: cuDNN / splash,
#      bf16 numerics, the stage programs, sharded updates), on the accelerator, not the CPU;
#   3. the pod fit check is CPU-only (python -m earl_jax.parallel.fit) and is not repeated here;
#   4. five training steps of the Qwen2.5-0.5B config with random weights at 2K context
#      (launch/train.py, the char tokenizer: no download);
#   5. the rollout / reference / update tokens/s table of that config at 2K context;
#   6. continuous vs turn-synchronous rollout on the long-tail workload with a ~110M model.
# Each section has its own time limit (S2..S6 seconds, environment) so that one slow section
# leaves the others their time; the defaults fit one 10-minute run on an H200.
# Usage, from the repository root: bash benchmarks/accelerator_check.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-${OUT:-/tmp/earl_accelerator_check}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset XLA_FLAGS  # no simulated CPU devices: the accelerator's own
export JAX_PLATFORMS=""  # tests/conftest.py only defaults it to cpu when unset
status=0

echo "== 1. devices"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__); print(jax.devices())" || status=1

echo "== 2. accelerator-relevant tests (each file alone, stopping at its first failure, so that
# a time limit still leaves every earlier file's failure with its traceback in tests.txt)"
for f in tests/model/attention_test.py tests/model/transformer_test.py \
  tests/parallel/executables_test.py tests/rl/mixed_precision_test.py \
  tests/rl/update_sharded_test.py tests/sampler/slots_test.py tests/rl/rollout_test.py; do
  timeout "${S2:-40}" python -m pytest -q -x --tb=short -p no:cacheprovider "$f" \
    >>"$OUT/tests.txt" 2>&1 || status=1
  echo "$f: $(tail -n 1 "$OUT/tests.txt")"
done

echo "== 4. five training steps, Qwen2.5-0.5B architecture, random weights, 2K context"
ARCH="--config.model.vocab_size=151936 --config.model.embed_dim=896 --config.model.mlp_dim=4864 \
  --config.model.num_layers=24 --config.model.num_heads=14 --config.model.num_kv_heads=2 \
  --config.model.head_dim=64 --config.model.qkv_bias=True --config.model.tie_embeddings=True \
  --config.model.rope.theta=1000000.0"
# shellcheck disable=SC2086
timeout "${S4:-150}" python launch/train.py --config=configs/connect_four_qwen2_5_0_5b.py \
  --workdir="$OUT/train_0_5b" --config.pretrained_path= --config.tokenizer.kind=char $ARCH \
  --config.model.max_seq_len=2048 --config.rollout.max_context=2048 \
  --config.train.num_steps=5 --config.train.eval_every=0 --config.train.baselines='()' \
  2>&1 | tail -n 15 || status=1
python - "$OUT/train_0_5b" <<'PY' || status=1
import sys
from earl_jax import metrics
for r in metrics.read_metrics(sys.argv[1]):
  print(r["step"], {k: round(v, 3) for k, v in r.items() if k.startswith(("time/", "update/loss", "tokens_per"))})
PY

echo "== 5. stage throughput, Qwen2.5-0.5B config, random weights, 2K context"
timeout "${S5:-90}" python benchmarks/stage_throughput.py --config=configs/connect_four_qwen2_5_0_5b.py \
  --random_weights --context 2048 --repeats 3 2>&1 | grep -v '^[WI][0-9]' || status=1

echo "== 6. continuous vs turn-synchronous rollout, long-tail workload, ~110M-parameter model"
timeout "${S6:-150}" python benchmarks/rollout.py --parts longtail --width 1024 --layers 8 \
  --episodes 64 --latencies 0 --repeats 2 2>&1 | grep -v '^[WI][0-9]' || status=1

echo "== done: exit status $status"
exit $status
