#!/usr/bin/env bash
# The Python package's tests: a virtual environment in build-py/venv with PyTorch, NumPy and
# pytest (from PyPI), `pip install .` into it (the CPU-only library unless FUSEKIT_PY_CUDA=ON, so
# that CI compiles the kernels once; ccache shares build-cpu's objects), then pytest on
# python/tests: the bindings on NumPy arrays, and every torch operator on the CPU, and on a GPU
# when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
venv=${FUSEKIT_PY_VENV:-build-py/venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch numpy pytest transformers tokenizers
echo "test-python: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') in $venv ($(( $(date +%s) - start )) s)"
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
cuda=${FUSEKIT_PY_CUDA:-OFF}
"$venv/bin/python" -m pip install -q . -C cmake.define.FUSEKIT_CUDA="$cuda" -C cmake.define.FUSEKIT_WERROR="${FUSEKIT_WERROR:-OFF}" \
  -C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache -C cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache
echo "test-python: package built ($(( $(date +%s) - start )) s)"
(cd build-py && "../$venv/bin/python" -m pytest -q -p no:cacheprovider ../python/tests)
echo "test-python: built and tested in $(( $(date +%s) - start )) s"
