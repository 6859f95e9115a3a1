#!/usr/bin/env bash
# Installs what fusekit needs (Debian/Ubuntu packages), then configures and builds it in build/
# (FUSEKIT_BUILD_DIR); a CUDA configuration downloads the CUTLASS/CuTe headers (PyPI's
# nvidia-cutlass) into the build folder as it configures. Safe to run again: it installs only
# what is missing and rebuilds incrementally, through ccache. CUDA kernels are built when a CUDA toolkit is found
# (nvcc on PATH or in /usr/local/cuda) unless FUSEKIT_CMAKE_ARGS holds -DFUSEKIT_CUDA=OFF;
# otherwise the library is CPU-only.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${FUSEKIT_BUILD_DIR:-build}

# Open MPI: the multi-rank tests (mpirun -np 2 and 4) and `fusekit train --distributed`.
packages=(build-essential cmake ninja-build git libgtest-dev nlohmann-json3-dev libcli11-dev libfmt-dev
          libdlpack-dev libxxhash-dev zlib1g-dev python3-pip python3-venv python3-dev ccache
          libopenmpi-dev openmpi-bin)
# The sanitizer / fuzz build (scripts/fuzz.sh --cmake-args) compiles with clang and its libFuzzer.
[[ " ${FUSEKIT_CMAKE_ARGS:-} " == *"-DCMAKE_CXX_COMPILER=clang++"* ]] && packages+=(clang libclang-rt-dev)
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

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if [[ " ${FUSEKIT_CMAKE_ARGS:-} " == *"-DFUSEKIT_SANITIZE="* ]]; then
  echo "setup: building the CPU-only library with sanitizers in $BUILD_DIR (${FUSEKIT_CMAKE_ARGS})"
elif [[ " ${FUSEKIT_CMAKE_ARGS:-} " == *" -DFUSEKIT_CUDA=OFF "* ]]; then
  echo "setup: building the CPU-only library in $BUILD_DIR (FUSEKIT_CUDA=OFF)"
elif command -v nvcc >/dev/null; then
  echo "setup: CUDA toolkit $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'): building the kernels"
else
  echo "setup: no CUDA toolkit found: building the CPU-only library (the specs are the backend)"
fi

# ccache keys on paths relative to the checkout, so worktrees and CI's fresh clone share hits.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
# The sanitizer build compiles with -g, whose debug info names the build folder: without this a
# checkout elsewhere (CI's clone) would miss the cache on every file.
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-true}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache ${FUSEKIT_CMAKE_ARGS:-} >/dev/null
start=$(date +%s)
cmake --build "$BUILD_DIR" -j "$(nproc)"
echo "setup: build finished in $(( $(date +%s) - start )) s"
