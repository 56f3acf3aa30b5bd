#!/usr/bin/env bash
# Run on EVERY worker of a TPU VM pod slice, e.g.:
#   gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --worker=all \
#     --command="cd earl_jax && bash launch/tpu_pod.sh configs/connect_four_qwen2_5_72b.py /mnt/gcs/run"
# jax.distributed.initialize() discovers the pod's coordinator and process ids by itself on TPU VMs.
set -euo pipefail
config=${1:?usage: tpu_pod.sh <config.py> <workdir> [--config.x=y ...]}
workdir=${2:?usage: tpu_pod.sh <config.py> <workdir> [--config.x=y ...]}
shift 2
cd "$(dirname "$0")/.."
[ -d .venv ] || { python3 -m venv .venv && .venv/bin/pip install -q -e . "jax[tpu]"; }
exec .venv/bin/python launch/train.py --config="$config" --workdir="$workdir" --multihost "$@"
