#!/usr/bin/env bash
# Trains kimi_mini on the GPU machine (one H200: ~185 s of training, ~30 s of start-up, held-out
# evaluation and export) and leaves config.json, model.safetensors, train_log.json and
# train_stdout.log in OUT_DIR. Copy the first three into examples/kimi_mini/ and commit them.
#
#   bash examples/kimi_mini/train_on_device.sh OUT_DIR [TRAIN_SECONDS [DATA_WORKERS]]
#
# It can run in the background of a device call that also builds megamoe: the data workers use
# DATA_WORKERS cores (default 8), the rest are free for the build.
set -euo pipefail
out=${1:?usage: train_on_device.sh OUT_DIR [TRAIN_SECONDS [DATA_WORKERS]]}
seconds=${2:-185}
workers=${3:-8}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
PYTHONUNBUFFERED=1 python3 "$here/train.py" --out "$out" --time-budget "$seconds" \
  --workers "$workers" 2>&1 | tee "$out/train_stdout.log"
