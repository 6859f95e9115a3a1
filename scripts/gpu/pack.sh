#!/usr/bin/env bash
# Builds $PACK_DIR/s10.tar.xz (PACK_DIR: .gpu-pack unless set; ignored, carry it to the device tool)
# for scripts/gpu/run.sh from the CUDA build in build/: the installed prefix (static library, headers, a CMake config
# without MPI, which the GPU machine lacks), the test binaries and programs named as arguments
# (`scripts/gpu/pack.sh attention_test norm_test pointwise_test fusekit`), stripped, and the shared
# libraries they need that the GPU machine lacks (Open MPI's and its dependencies).
set -euo pipefail
cd "$(dirname "$0")/../.."
P=/tmp/s10
rm -rf $P && mkdir -p $P/bin $P/lib
cmake --install build --prefix $P/pfx >/dev/null
rm -rf $P/pfx/bin
strip -g $P/pfx/lib/*.a
# The Python extension links the static library; MPI's objects are not pulled in by it.
sed -i 's/^set(FUSEKIT_WITH_MPI ON)/set(FUSEKIT_WITH_MPI OFF)/' $P/pfx/lib/cmake/fusekit/fusekitConfig.cmake
sed -i 's/;MPI::MPI_CXX//; s/MPI::MPI_CXX;//; s/MPI::MPI_CXX//' $P/pfx/lib/cmake/fusekit/fusekitTargets.cmake
for t in "$@"; do cp build/tests/$t $P/bin/ 2>/dev/null || cp build/$t $P/bin/; done
strip $P/bin/*
for b in $P/bin/*; do ldd $b; done | awk '/=>/ {print $3}' | sort -u | { grep -E "mpi|open-|hwloc|pmix|event|ucx|ucp|ucs|ucm|uct|fabric|psm|ibverbs|rdmacm|munge|nl-|efa" || true; } | xargs -r -I{} cp -L {} $P/lib/
du -sh $P/*
mkdir -p ${PACK_DIR:-.gpu-pack}
tar -C /tmp -cf - s10 | xz -T2 -6 > ${PACK_DIR:-.gpu-pack}/s10.tar.xz
ls -la ${PACK_DIR:-.gpu-pack}/s10.tar.xz
