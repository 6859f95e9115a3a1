#!/usr/bin/env bash
# A run on the lent GPU machine (the device tool, from the repository root, carrying $PACK_DIR
# (.gpu-pack unless set) with scripts/gpu/pack.sh's s10.tar.xz and .whl with nanobind's wheel, and Liger-Kernel's for liger runs):
#   PARTS="tests sanitize bench py pybench lm" bash scripts/gpu/run.sh
# tests: the C++ attention, norm, pointwise, GLU and loss tests (those packed); sanitize: memcheck and racecheck on attention
# cases of every sm_90 path; bench: the attention cases of `fusekit bench` (BENCH, a
# space-separated list of filters, each a case-name prefix; BENCH_ARGS, e.g. --breakdown); py: the
# Python package built there against the pack, its attention tests (PYTESTS); pybench: `python -m fusekit.bench` (PYBENCH, one
# filter); lm: the LM bench's runs (LM_RUNS) with a profile of one step, at each of LM_PRECISION
# (bf16 unless set; "bf16 autocast" for both; LM_BATCHES, 64 unless set, e.g. 64,128; LM_ARGS replaces
# "--warmup 2 --steps 4" and may override "--train-steps 0 --profile 30", e.g. "--warmup 6 --steps 20
# --corpus-limit 2MB"); recsys: the 16-bit table tests, memcheck and bench (pack recsys_test,
# models_test, fusekit); mlperf: the MLPerf DCNv2 model trained on one GPU (an H200 for f32 tables,
# any for MLPERF_DTYPE=bf16; pack the fusekit program); embedding: the sparse embedding backward's GPU tests,
# memcheck and bench, the packed fusekit against BASELINE_XZ (an xz-compressed fusekit of another build,
# carried in $PACK_DIR) in the same lease (pack recsys_test, models_test, fusekit; dist_nccl_dlrm_test
# for the sharded 16-bit tables).
set -uo pipefail
R=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
tar -C /tmp -xJf ${PACK_DIR:-.gpu-pack}/s10.tar.xz
export LD_LIBRARY_PATH=/tmp/s10/lib:${LD_LIBRARY_PATH:-}
B=/tmp/s10/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
step() { echo "=== $* ($(date +%T))"; }
has() { [[ " ${PARTS:-tests} " == *" $1 "* ]]; }
packed() { [ -x $B/$1 ]; }  # the test binaries not packed are skipped
if has tests; then
  packed attention_test && { step attention; timeout 240 $B/attention_test --gtest_filter="${ATTN_TESTS:--*2048*}" 2>&1 | tail -6; }
  packed norm_test && { step norm; $B/norm_test 2>&1 | tail -3; }
  packed pointwise_test && { step pointwise; $B/pointwise_test --gtest_filter='Convert*:*Rope*' 2>&1 | tail -3; }
  packed glu_test && { step glu; $B/glu_test --gtest_filter='GluGpu.*' 2>&1 | tail -3; }
  packed loss_test && { step loss; $B/loss_test 2>&1 | tail -3; }
fi
if has sanitize; then
  step memcheck
  packed attention_test && timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/attention_test \
    --gtest_filter="${MEMCHECK_TESTS:-Sm90/AttentionBackwardSm90VsSpec.*d64*:Sm90/AttentionSm90ForwardVsSpec.*d64*:Strided/AttentionStrided.GpuMatchesContiguous/bf16_d64_causal}" 2>&1 | tail -4
  packed glu_test && timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/glu_test \
    --gtest_filter='GluGpu.ActivateMatchesTheCpuOp:GluGpu.PreactGradMatchesTheCpuOp:GluGpu.BackwardFromPreactivationsMatchesSpecAndRecompute' 2>&1 | tail -2
  packed loss_test && timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/loss_test \
    --gtest_filter='Shapes/LossGpu.*' 2>&1 | tail -2
  packed pointwise_test && timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/pointwise_test \
    --gtest_filter='RopeLayouts.*' 2>&1 | tail -2
  packed norm_test && timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/norm_test \
    --gtest_filter='NormGpuMixed.*' 2>&1 | tail -2
  packed attention_test && { step racecheck
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 $B/attention_test \
    --gtest_filter="${RACECHECK_TESTS:-Sm90/AttentionSm90ForwardVsSpec.*d64*causal*}" 2>&1 | tail -3; }
fi
if has bench; then
  step bench
  for f in ${BENCH:-attention_fwd/ attention_bwd/}; do
    timeout 200 $B/fusekit bench ${BENCH_ARGS:-} --filter "$f" --json $OUT/bench_$(echo $f | tr '/' '_').json 2>&1 | grep -E "fused|dense|sm90|cublas" | grep -v "^ceiling"
  done
fi
if has py || has pybench || has lm; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  step pybuild
  cmake -S python -B /tmp/pyb -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=/tmp/s10/pfx \
    -DPython_EXECUTABLE=$(which python3) > /tmp/pyb.log 2>&1 && cmake --build /tmp/pyb >> /tmp/pyb.log 2>&1 || { tail -30 /tmp/pyb.log; exit 1; }
  cp /tmp/pyb/_C*.so python/fusekit/
  export PYTHONPATH=$R/python:$R/python/tests:/tmp/site PYTHONUNBUFFERED=1
fi
if has py; then
  step pytest
  python3 -m pytest -q -x -p no:cacheprovider ${PYTESTS:-python/tests/test_attention.py python/tests/test_attention_varlen.py} 2>&1 | tail -4
fi
if has pybench; then
  step pybench
  python3 -m fusekit.bench --filter "${PYBENCH:-attention}" --out $OUT 2>&1 | tail -14
fi
if has lm; then
  for p in ${LM_PRECISION:-bf16}; do
    step lm $p
    python3 -m fusekit.bench.lm --config small --precision $p --batches ${LM_BATCHES:-64} --train-steps 0 --profile 30 \
      ${LM_ARGS:---warmup 2 --steps 4} --runs "${LM_RUNS:-fusekit_attn_compile,fusekit_nomask_compile,nomask_compile}" \
      --cache /tmp/lm-cache --out $OUT/lm_$p.json 2>&1 | tail -${LM_TAIL:-120}
  done
fi
if has recsys; then
  # The embedding ops on 16-bit tables: their GPU tests, memcheck, and the bench against f32 tables.
  step recsys
  packed recsys_test && $B/recsys_test --gtest_filter='*SixteenBit*:StochasticRounding.*' 2>&1 | tail -3
  packed models_test && $B/models_test --gtest_filter='DlrmGpu.SixteenBit*:Dlrm.SixteenBit*' 2>&1 | tail -3
  packed recsys_test && timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/recsys_test \
    --gtest_filter="${MEMCHECK_TESTS:-*SixteenBitTablesMatchSpec/1:*SixteenBitTablesMatchSpec/4:*SixteenBitTablesMatchSpec/9:*SixteenBitTablesMatchSpec/12}" 2>&1 | tail -2
  packed fusekit && $B/fusekit bench --filter recsys/embedding_bf16_ \
    --json $OUT/recsys_bf16.json 2>&1 | tail -8
fi
if has embedding; then
  step embedding
  packed recsys_test && timeout 200 $B/recsys_test --gtest_filter='*Gpu*:StochasticRounding.*' 2>&1 | tail -3
  packed recsys_test && timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/recsys_test \
    --gtest_filter="${MEMCHECK_TESTS:-Shapes/RecsysEmbeddingGpu.*/12:Shapes/RecsysEmbeddingGpu.*/16:Shapes/RecsysEmbeddingGpu.*/21}" 2>&1 | tail -2
  packed models_test && timeout 200 $B/models_test --gtest_filter='*DlrmGpu*:Dlrm.SixteenBit*' 2>&1 | tail -3
  packed dist_nccl_dlrm_test && timeout 200 $B/dist_nccl_dlrm_test --gtest_filter='*SixteenBit*:*ThreadsAGpu*' 2>&1 | tail -3
  bins="$B/fusekit"
  if [ -n "${BASELINE_XZ:-}" ]; then xz -dc "$BASELINE_XZ" > /tmp/fusekit_baseline && chmod +x /tmp/fusekit_baseline; bins="$bins /tmp/fusekit_baseline"; fi
  for f in recsys/embedding_bwd recsys/embedding_bf16_bwd dlrm/train/kaggle_dot_b; do
    for b in $bins; do
      echo "--- $(basename $b) $f"
      timeout 120 $b bench --filter $f --json $OUT/$(basename $b)_$(echo $f | tr '/' '_').json 2>&1 | grep -E "fused|kaggle" | head -8
    done
  done
fi
if has mlperf; then
  # Issue 42's MLPerf DLRM-DCNv2 model on one GPU: its 104 GB of fp32 tables on an H200, or with
  # MLPERF_DTYPE=bf16 its 52 GB of bf16 tables on an H100 too.
  step mlperf
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  dtype=${MLPERF_DTYPE:-f32}
  if [ "$dtype" = f32 ] && [ "$mib" -lt 120000 ]; then echo "mlperf: skipped, $mib MiB is less than the f32 tables' 104 GB"; else
  timeout ${MLPERF_TIMEOUT:-500} $B/fusekit train --config configs/mlperf_dcnv2.json --train-samples 3932160 \
    --test-samples 262144 --steps ${MLPERF_STEPS:-60} --print-freq 10 --data-workers ${MLPERF_WORKERS:-12} \
    --embedding-dtype $dtype --metrics-json $OUT/mlperf_dcnv2_$dtype.json 2>&1 | tail -30
  fi
fi
step done
