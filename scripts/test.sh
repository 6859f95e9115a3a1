#!/usr/bin/env bash
# The test command: every test of both configurations. First the CPU-only library (build-cpu/,
# FUSEKIT_CUDA=OFF: what a machine without a CUDA toolkit builds), then, where a CUDA toolkit is
# found, the CUDA one (build/); the Python package, built against the CPU-only configuration and
# tested with PyTorch (scripts/test-python.sh); then the CPU suite again under AddressSanitizer and
# UndefinedBehaviorSanitizer (build-asan/, clang), and each fuzz target for FUSEKIT_FUZZ_SECONDS
# (60) from its seed corpus (scripts/fuzz.sh); last, the README's `pip install ".[torch]"` and its
# example in a fresh clone and virtual environment (scripts/test-fresh-install.sh). Each
# configuration is set up and built by scripts/setup.sh, with fusekit's own compiler warnings as
# errors (FUSEKIT_WERROR). GPU tests skip, saying why, on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export FUSEKIT_WERROR=${FUSEKIT_WERROR:-ON}

run_config() {  # NAME BUILD_DIR CMAKE_ARGS
  local start=$(date +%s)
  FUSEKIT_BUILD_DIR=$2 FUSEKIT_CMAKE_ARGS="$3 -DFUSEKIT_WERROR=$FUSEKIT_WERROR" ./scripts/setup.sh
  ctest --test-dir "$2" --output-on-failure -j "$(nproc)"
  echo "test: $1 configuration built and tested in $(( $(date +%s) - start )) s"
}

run_config cpu-only "${FUSEKIT_CPU_BUILD_DIR:-build-cpu}" "-DFUSEKIT_CUDA=OFF ${FUSEKIT_CMAKE_ARGS:-}"
scripts/test-python.sh
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  run_config cuda "${FUSEKIT_BUILD_DIR:-build}" "${FUSEKIT_CMAKE_ARGS:-}"
else
  echo "test: no CUDA toolkit found: the CUDA configuration is not built here"
fi
start=$(date +%s)
run_config "sanitizer (address,undefined)" "${FUSEKIT_SANITIZE_BUILD_DIR:-build-asan}" "$(scripts/fuzz.sh --cmake-args)"
FUSEKIT_SANITIZE_BUILD_DIR=${FUSEKIT_SANITIZE_BUILD_DIR:-build-asan} scripts/fuzz.sh "${FUSEKIT_FUZZ_SECONDS:-60}"
echo "test: sanitizer build, its tests and the fuzz targets took $(( $(date +%s) - start )) s"
scripts/test-fresh-install.sh
