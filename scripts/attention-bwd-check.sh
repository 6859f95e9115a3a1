#!/usr/bin/env bash
# The tensor-core attention backward on a GPU, in one call: its tests against the spec (every
# AttentionBackward* and AttentionVarlen* test), compute-sanitizer memcheck, racecheck and
# synccheck on four small dense cases that between them cover tails, GQA, both causal alignments, a
# window, the softcap and both dq modes, and on the varlen San/ cases (packed sequences of 0, 1 and
# a few tiles), then (unless --skip-bench) `fusekit bench --filter attention_bwd/`. Logs go to $OUT (the
# device tool's folder) or out/attention-bwd; a summary prints last.
#
#   scripts/attention-bwd-check.sh [--bin DIR] [--skip-bench] [--skip-sanitizer]
# DIR holds fusekit and attention_test (default: build, build/tests); scripts/stage-gpu.sh packs them.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=""; bench=1; sanitize=1
while (($#)); do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --skip-bench) bench=0; shift ;;
    --skip-sanitizer) sanitize=0; shift ;;
    *) echo "attention-bwd-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
out=${OUT:-out/attention-bwd}
mkdir -p "$out"
if [ -z "$bin" ]; then test_bin=build/tests/attention_test; fusekit=build/fusekit
else test_bin=$bin/attention_test; fusekit=$bin/fusekit; fi
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"

timeout 900 "$test_bin" --gtest_filter='*AttentionBackward*:*AttentionVarlen*' >"$out/tests.log" 2>&1
rc=$?
grep -a -E '^\[  (FAILED|PASSED|SKIPPED) ' "$out/tests.log" | sort -u | head -40
grep -a -E 'Failure|rel err|differ|\[note\]' "$out/tests.log" | head -60
summary+=("tests rc=$rc ($(grep -a -c '^\[       OK \]' "$out/tests.log") ok, $(grep -a -c '^\[  FAILED  \] .*/' "$out/tests.log") failed)")

if ((sanitize)); then
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  p='TensorCore/AttentionBackwardGpuVsSpec.MatchesTheSpec/'
  f="$p"d64_q17_k129:"$p"d64_gqa_8_over_2_causal_bottom_right:"$p"d96_softcap:"$p"d128_deterministic_causal_window
  f="$f:San/AttentionVarlenGpuVsSpec.*"
  for tool in memcheck racecheck synccheck; do
    extra=()
    [ $tool = memcheck ] && extra=(--leak-check no)
    [ $tool = racecheck ] && extra=(--racecheck-report all)
    timeout 300 "$cs" --tool $tool --error-exitcode 1 "${extra[@]}" "$test_bin" --gtest_filter="$f" \
      >"$out/$tool.log" 2>&1
    rc=$?
    tail -5 "$out/$tool.log"
    summary+=("$tool rc=$rc: $(grep -a -E 'ERROR SUMMARY|RACECHECK SUMMARY|hazard' "$out/$tool.log" | tail -1)")
  done
fi

if ((bench)); then
  timeout 400 "$fusekit" bench --filter attention_bwd/ --json "$out/bench.json" >"$out/bench.log" 2>&1
  rc=$?
  tail -30 "$out/bench.log"
  summary+=("bench rc=$rc")
fi
echo "== summary"
printf '%s\n' "${summary[@]}"
