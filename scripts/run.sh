#!/usr/bin/env bash
# The main job. Until the DLRM trainer exists: on a GPU, check every kernel against its spec and
# run the benchmark suite (JSON per family in out/bench/); on a machine without one, the spec
# checks alone.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
bin=${FUSEKIT_BUILD_DIR:-build}/fusekit
"$bin" info
"$bin" check
if "$bin" info | grep -q '^cuda:0'; then
  mkdir -p out/bench
  "$bin" bench --json out/bench/all.json --json-dir out/bench "$@"
else
  echo "run: no GPU here, so no benchmarks (fusekit bench needs one)"
fi
