#!/usr/bin/env bash
# Times two builds of fusekit on the same GPU, family by family and in alternation (BEFORE's
# family, then AFTER's), so that both see the same card, clocks and temperature; then compares
# them with scripts/bench-diff.py. For a change that must not move speed (a refactoring, a build
# flag): each family's median time within TOLERANCE (default 0.02) of before.
#
#   scripts/bench-compare.sh BEFORE_FUSEKIT AFTER_FUSEKIT OUT_DIR [FAMILY...]
#
# FAMILY defaults to every family of the bench; OUT_DIR gets before/<family>.json,
# after/<family>.json and diff.md.
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1 after=$2 out=$3
shift 3
families=("$@")
((${#families[@]})) || families=(pointwise primitives quant glu qgemm mlp lora recsys dlrm)
mkdir -p "$out/before" "$out/after"
for f in "${families[@]}"; do
  for side in before after; do
    bin=$before
    [ "$side" = after ] && bin=$after
    start=$(date +%s)
    "$bin" bench --filter "$f/" --json-dir "$out/$side" >"$out/$side/$f.log" 2>&1 ||
      { tail -20 "$out/$side/$f.log"; echo "bench-compare: $side $f failed" >&2; exit 1; }
    echo "bench-compare: $f $side in $(( $(date +%s) - start )) s"
  done
done
python3 scripts/bench-diff.py --tolerance "${TOLERANCE:-0.02}" "$out/before" "$out/after" | tee "$out/diff.md"
