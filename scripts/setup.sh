#!/usr/bin/env bash
# Installs what fusekit needs (Debian/Ubuntu packages, the CUTLASS/CuTe headers), then configures
# and builds it in build/. Safe to run again: it installs only what is missing and rebuilds
# incrementally. CUDA kernels are built when a CUDA toolkit is found (nvcc on PATH or in
# /usr/local/cuda); otherwise the library is CPU-only.
set -euo pipefail
cd "$(dirname "$0")/.."

CUTLASS_VERSION=4.2.0.0
BUILD_DIR=${FUSEKIT_BUILD_DIR:-build}

packages=(build-essential cmake ninja-build git libgtest-dev nlohmann-json3-dev libcli11-dev libfmt-dev
          libdlpack-dev zlib1g-dev python3-pip unzip)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# CUTLASS/CuTe headers from the PyPI wheel nvidia-cutlass (cutlass_library/source/include).
if [ ! -f .deps/cutlass/include/cute/tensor.hpp ]; then
  echo "setup: fetching the CUTLASS ${CUTLASS_VERSION} headers (PyPI nvidia-cutlass)"
  rm -rf .deps/cutlass .deps/wheel && mkdir -p .deps/wheel .deps/cutlass
  python3 -m pip download -q --no-deps --dest .deps/wheel "nvidia-cutlass==${CUTLASS_VERSION}"
  unzip -q .deps/wheel/nvidia_cutlass-*.whl 'cutlass_library/source/include/*' -d .deps/wheel/unpacked
  mv .deps/wheel/unpacked/cutlass_library/source/include .deps/cutlass/include
  rm -rf .deps/wheel
fi

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if command -v nvcc >/dev/null; then
  echo "setup: CUDA toolkit $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'): building the kernels"
else
  echo "setup: no CUDA toolkit found: building the CPU-only library (the specs are the backend)"
fi

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${FUSEKIT_CMAKE_ARGS:-} >/dev/null
start=$(date +%s)
cmake --build "$BUILD_DIR" -j "$(nproc)"
echo "setup: build finished in $(( $(date +%s) - start )) s"
