#!/usr/bin/env bash
# The test command: set up and build (scripts/setup.sh), then run every test. GPU tests skip,
# saying why, on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
ctest --test-dir "${FUSEKIT_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
