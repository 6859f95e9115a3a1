#!/usr/bin/env bash
# Copies the built binaries into .gpu/bin (ignored by git) so that the device tool can carry them
# to a GPU machine: `carry: [".gpu"]`, then `scripts/gpu-check.sh --bin .gpu/bin` there.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FUSEKIT_BUILD_DIR:-build}
rm -rf .gpu/bin && mkdir -p .gpu/bin
cp "$build/fusekit" "$build"/tests/*_test .gpu/bin/
strip --strip-debug .gpu/bin/* 2>/dev/null || true
du -sh .gpu/bin
