#!/usr/bin/env bash
# Copies the built binaries into .gpu/bin (ignored by git), stripped, and packs them into
# .gpu-pack/bin.tar.xz: together they are over the device tool's 64 MiB carry limit, the archive
# xz-compressed, about a sixth of that. On the GPU machine (`carry: [".gpu-pack"]`):
#   mkdir -p /tmp/g && tar -C /tmp/g -xJf .gpu-pack/bin.tar.xz
#   scripts/gpu-check.sh --bin /tmp/g/bin --skip-bench                      # tests, sanitizers
#   scripts/gpu-check.sh --bin /tmp/g/bin --skip-tests --skip-sanitizer     # the bench
# (two calls: together they come close to one call's 10-minute limit).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FUSEKIT_BUILD_DIR:-build}
rm -rf .gpu/bin .gpu-pack && mkdir -p .gpu/bin .gpu-pack
cp "$build/fusekit" "$build"/tests/*_test .gpu/bin/
strip .gpu/bin/* 2>/dev/null || true
XZ_OPT="-T0 -6" tar -C .gpu -cJf .gpu-pack/bin.tar.xz bin
du -sh .gpu/bin .gpu-pack/bin.tar.xz
