#!/usr/bin/env bash
# The main job: train DLRM on the built-in synthetic Criteo-like data and print the summary
# (train loss, test logloss, AUC, accuracy, samples/s, peak memory), then check every op against
# its spec. With a GPU: the DLRM Kaggle model with full table sizes (configs/dlrm_kaggle.json,
# 33.8M rows) trained by the fused CUDA implementation, then the benchmark suite (JSON per family
# in out/bench/). Without one: the CPU default (tables capped at 100k rows). Extra arguments go to
# `fusekit train` (e.g. --steps 6000, --impl reference).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
bin=${FUSEKIT_BUILD_DIR:-build}/fusekit
"$bin" info
if "$bin" info | grep -q '^cuda:0'; then
  "$bin" train --config configs/dlrm_kaggle.json --device cuda --impl fused --data-workers "$(nproc)" "$@"
else
  "$bin" train --device cpu "$@"
fi
"$bin" check
if "$bin" info | grep -q '^cuda:0'; then
  mkdir -p out/bench
  "$bin" bench --json out/bench/all.json --json-dir out/bench
else
  echo "run: no GPU here, so no benchmarks (fusekit bench needs one)"
fi
