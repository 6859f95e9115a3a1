#!/usr/bin/env bash
# Runs each fuzz target (fuzz/: the TSV / gzip reader, the binary format reader, the checkpoint
# loader, the distributed checkpoint's readers, the vocabulary reader, the data set's manifest)
# for SECONDS (default 60) on the sanitizer build, from the seed corpus: fuzz/corpus/ and the
# files fuzz_make_seeds writes. New inputs the fuzzer finds are kept in BUILD/fuzz-corpus/ (a
# longer run continues from them); a finding stops the run with the fuzzer's report and the input
# that triggers it, saved as BUILD/fuzz-findings/<target>-crash-*.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]        e.g. scripts/fuzz.sh 600 checkpoint_fuzz
#
# The build is made by scripts/test.sh (or: FUSEKIT_BUILD_DIR=build-asan FUSEKIT_CMAKE_ARGS="$(scripts/fuzz.sh --cmake-args)"
# scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# Without MPI: LeakSanitizer reports Open MPI's own allocations; the distributed code still runs
# here through the single-process communicator (dist_test), the multi-rank runs in build-cpu/.
cmake_args="-DFUSEKIT_CUDA=OFF -DCMAKE_CXX_COMPILER=clang++ -DFUSEKIT_SANITIZE=address,undefined -DFUSEKIT_FUZZ=ON -DFUSEKIT_MPI=OFF"
if [ "${1:-}" = "--cmake-args" ]; then echo "$cmake_args"; exit 0; fi
seconds=${1:-60}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(tsv_reader_fuzz binary_reader_fuzz checkpoint_fuzz dist_checkpoint_fuzz vocabulary_fuzz
                                shards_fuzz)
build=${FUSEKIT_SANITIZE_BUILD_DIR:-build-asan}

"$build/fuzz/fuzz_make_seeds" "$build/fuzz-seeds" tests/data/criteo_malformed.tsv >/dev/null
mkdir -p "$build/fuzz-findings"
for t in "${targets[@]}"; do
  case $t in
    tsv_reader_fuzz) seeds=(fuzz/corpus/tsv "$build/fuzz-seeds/tsv") ;;
    binary_reader_fuzz) seeds=("$build/fuzz-seeds/binary") ;;
    checkpoint_fuzz) seeds=("$build/fuzz-seeds/checkpoint") ;;
    dist_checkpoint_fuzz) seeds=(fuzz/corpus/dist_checkpoint "$build/fuzz-seeds/dist_checkpoint") ;;
    vocabulary_fuzz) seeds=(fuzz/corpus/vocabulary "$build/fuzz-seeds/vocabulary") ;;
    shards_fuzz) seeds=("$build/fuzz-seeds/shards") ;;
    *) echo "fuzz: no target $t" >&2; exit 2 ;;
  esac
  mkdir -p "$build/fuzz-corpus/$t"
  log="$build/fuzz-findings/$t.log"
  dict=()  # fuzz/<target>.dict: tokens of the format, where a target has one
  [ -f "fuzz/$t.dict" ] && dict=(-dict="fuzz/$t.dict")
  if ! "$build/fuzz/$t" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
       "${dict[@]}" -artifact_prefix="$build/fuzz-findings/$t-" "$build/fuzz-corpus/$t" "${seeds[@]}" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz: $t found a fault in ${seconds} s (the input is in $build/fuzz-findings/)" >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  echo "fuzz: $t: ${runs:-?} inputs in ${seconds} s, no finding (corpus $(ls "$build/fuzz-corpus/$t" | wc -l) files)"
done
