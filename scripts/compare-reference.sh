#!/usr/bin/env bash
# fusekit train against the DLRM reference (facebookresearch/dlrm, dlrm_s_pytorch.py) on the same
# Criteo-format file with raw 32-bit hashed categorical values, with the reference's Kaggle
# recipe (bot 13-512-256-64-16, top 512-256-1, dim 16, dot, SGD lr 0.1, batch 128, one epoch,
# its 7-day split: days 0-5 train, day 6's first half test).
#
#   scripts/compare-reference.sh [--rows N] [--seeds "1 2 3"] [--work DIR] [--reference DIR] [--python PY]
#
# The file comes from `fusekit data synth` (Zipf-distributed categories whose raw values are a
# 32-bit scramble of the rank: the modulus hash makes them collide, as real Criteo hashes do;
# labels from a hidden model). Both run the reference's Kaggle command line; fusekit's
# --processed-data-file preprocesses the file once (the vocabulary over every day, as the reference
# builds its dictionaries) and trains from the shards, on the CPU and, when fusekit was built
# with CUDA and a GPU is present, on the GPU; and once with the modulus hash (fusekit's default
# 100,000-row cap) instead, for contrast. With --reference pointing at a checkout of facebookresearch/dlrm (not part of this
# repository; its Python needs torch, numpy, scikit-learn, tensorboard, tqdm and mlperf-logging),
# the reference runs on the same file from a temporary copy: --max-ind-range 2000000000 keeps its
# int32 parsing of the hex values from overflowing under NumPy 2 (values below 2^31 are unchanged
# by it; fusekit gets the same flag), --mlperf-logging makes it compute the test AUC,
# --test-freq tests once at the end, and where the installed torch no longer takes the profiler's
# `use_cuda` argument the copy drops it. Prints one line per run: test AUC and accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
rows=300000 seeds="1 2 3" work=build/compare-reference reference="" python=python3
while (($#)); do
  case $1 in
    --rows) rows=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --reference) reference=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    *) echo "compare-reference: unknown argument $1" >&2; exit 2 ;;
  esac
done
fusekit=${FUSEKIT:-build/fusekit}
[[ -x $fusekit ]] || fusekit=build-cpu/fusekit
mkdir -p "$work"
work=$(cd "$work" && pwd)
data="$work/train.txt"
# The file (and the reference's preprocessed days next to it) is reused by later runs in $work.
if [[ -f $work/rows && $(cat "$work/rows") != "$rows" ]]; then
  echo "compare-reference: $work holds a file of $(cat "$work/rows") rows; remove it or pick another --work" >&2
  exit 2
fi
[[ -f $data ]] || { "$fusekit" data synth --rows "$rows" --seed 2024 --out "$data" && echo "$rows" > "$work/rows"; }
# The reference's Kaggle command line (bench/dlrm_s_criteo_kaggle.sh) with the flags above, run by
# both; each gets its own --processed-data-file (fusekit preprocesses the file into its directory
# once, the reference into its npz files).
steps=$(( (rows / 7 * 6 + (rows % 7 < 6 ? rows % 7 : 6) + 127) / 128 ))
reference_flags() {
  echo --arch-sparse-feature-size=16 --arch-mlp-bot=13-512-256-64-16 --arch-mlp-top=512-256-1 \
    --data-generation=dataset --data-set=kaggle --raw-data-file="$data" --loss-function=bce --round-targets=True \
    --learning-rate=0.1 --mini-batch-size=128 --print-freq=1024 --print-time --max-ind-range=2000000000 \
    --mlperf-logging --test-freq="$steps" --test-mini-batch-size=16384 --numpy-rand-seed="$1"
}
devices=(cpu)
"$fusekit" info 2>/dev/null | grep -q "^cuda:0:" && devices+=(cuda)
for s in $seeds; do
  for d in "${devices[@]}"; do
    impl=reference
    [[ $d == cuda ]] && impl=fused
    # fusekit's model seed is its own flag (the reference seeds NumPy once for both).
    "$fusekit" train $(reference_flags "$s") --processed-data-file="$work/fusekit_processed" --seed "$s" \
      --device "$d" --impl "$impl" --data-workers 2 --metrics-json "$work/fusekit_${d}_seed$s.json" |
      sed -n "s/^summary: .*\(test logloss [0-9.]*, AUC [0-9.]*, accuracy [0-9.]*\).*/fusekit $d seed $s: \1/p"
  done
  if [[ -n $reference ]]; then
    copy="$work/reference"
    rm -rf "$copy" && cp -r "$reference" "$copy"
    if ! "$python" -c "import inspect, torch; assert 'use_cuda' in inspect.signature(torch.autograd.profiler.profile).parameters" 2>/dev/null; then
      sed -i 's/args.enable_profiling, use_cuda=use_gpu, record_shapes=True/args.enable_profiling, record_shapes=True/' \
        "$copy/dlrm_s_pytorch.py"
    fi
    (cd "$copy" && "$python" dlrm_s_pytorch.py $(reference_flags "$s") --processed-data-file="$work/kaggle_processed.npz" 2>&1) |
      grep "^recall" | tail -1 |
      sed "s/.* auc \([0-9.]*\), best auc [0-9.]*, accuracy \([0-9.]*\) %.*/reference seed $s: AUC \1, accuracy \2 %/"
  fi
done
"$fusekit" train $(reference_flags 1 | sed 's/--max-ind-range=2000000000/--max-ind-range=100000/') --seed 1 \
  --data-hash reference --metrics-json "$work/fusekit_hash.json" |
  sed -n "s/^summary: .*\(test logloss [0-9.]*, AUC [0-9.]*, accuracy [0-9.]*\).*/fusekit cpu, modulus hash (max_ind_range 100000): \1/p"
