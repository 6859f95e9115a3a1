#!/usr/bin/env bash
# The main job: train DLRM on the built-in synthetic Criteo-like data and print the summary
# (train loss, test logloss, AUC, accuracy, samples/s), then check every op against its spec. The
# trainer runs on the CPU for now (its CUDA implementations are the next step: `--device cuda`
# says so); on a GPU machine the job also runs the benchmark suite (JSON per family in out/bench/).
# Extra arguments go to `fusekit train` (e.g. --steps 6000, --config configs/dlrm_kaggle.json).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
bin=${FUSEKIT_BUILD_DIR:-build}/fusekit
"$bin" info
"$bin" train --device cpu "$@"
"$bin" check
if "$bin" info | grep -q '^cuda:0'; then
  mkdir -p out/bench
  "$bin" bench --json out/bench/all.json --json-dir out/bench
else
  echo "run: no GPU here, so no benchmarks (fusekit bench needs one)"
fi
