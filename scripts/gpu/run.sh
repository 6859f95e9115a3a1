#!/usr/bin/env bash
# A run on the lent GPU machine (the device tool, from the repository root, carrying .gpu-pack with
# scripts/gpu/pack.sh's s10.tar.xz and .whl with nanobind's wheel): `PART=a bash scripts/gpu/run.sh`.
# PART=a: C++ tests, sanitizers, benches; b: the Python package built there against the pack, its
# tests and benches (the LM bench's attention runs); c, d: the attention layout benches.
set -uo pipefail
R=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
tar -C /tmp -xJf .gpu-pack/s10.tar.xz
export LD_LIBRARY_PATH=/tmp/s10/lib:${LD_LIBRARY_PATH:-}
B=/tmp/s10/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
step() { echo "=== $* ($(date +%T))"; }
if [ "${PART:-a}" = a ]; then
  step strided; $B/attention_test --gtest_filter='*Strided*' 2>&1 | tail -25
  step attention; $B/attention_test --gtest_filter='-*2048*:*Strided*' 2>&1 | tail -8
  step norm; $B/norm_test 2>&1 | tail -4
  step pointwise; $B/pointwise_test --gtest_filter='Convert*:*Rope*' 2>&1 | tail -4
  step memcheck
  compute-sanitizer --tool memcheck --error-exitcode 9 $B/attention_test \
    --gtest_filter='Strided/AttentionStrided.GpuMatchesContiguous/bf16_d64_causal:Strided/AttentionStrided.GpuMatchesContiguous/bf16_d64_varlen_causal:Strided/AttentionStrided.GpuMatchesContiguous/bf16_d96:ConvertStrided*' 2>&1 | tail -4
  compute-sanitizer --tool memcheck --error-exitcode 9 $B/norm_test --gtest_filter='*Gpu*768*:*Gpu*5x5120*' 2>&1 | tail -3
  step racecheck
  compute-sanitizer --tool racecheck --error-exitcode 9 $B/attention_test \
    --gtest_filter='Strided/AttentionStrided.GpuMatchesContiguous/f16_d128_gqa2' 2>&1 | tail -3
  step bench
  for f in _bshd attention_bwd/bf16_b4_h16_s2048_d attention_fwd/bf16_b4_h16_s4096_d128 rms_norm; do
    $B/fusekit bench --filter "$f" --json $OUT/bench_$(echo $f | tr '/' '_').json 2>&1 | grep -v "^$" | tail -14
  done
fi
if [ "${PART:-a}" = b ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  step pybuild
  cmake -S python -B /tmp/pyb -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=/tmp/s10/pfx \
    -DPython_EXECUTABLE=$(which python3) > /tmp/pyb.log 2>&1 && cmake --build /tmp/pyb >> /tmp/pyb.log 2>&1 || { tail -30 /tmp/pyb.log; exit 1; }
  cp /tmp/pyb/_C*.so python/fusekit/
  export PYTHONPATH=$R/python:$R/python/tests:/tmp/site PYTHONUNBUFFERED=1
  step pytest
  python3 -m pytest -q -x -p no:cacheprovider python/tests/test_attention.py python/tests/test_attention_varlen.py \
    python/tests/test_norm.py python/tests/test_rope.py 2>&1 | tail -6
  step layers
  python3 -m fusekit.bench --filter rms_norm --out $OUT 2>&1 | tail -12
  step lm
  python3 -m fusekit.bench.lm --config small --precision bf16 --batches 64 --warmup 2 --steps 4 --train-steps 0 \
    --runs fusekit_attn_compile,fusekit_nomask_compile,nomask_compile --out $OUT/lm.json 2>&1 | tail -15
fi
if [ "${PART:-a}" = c ]; then
  step strided; $B/attention_test --gtest_filter='*Strided*Gpu*' 2>&1 | tail -1
  step bench
  for f in attention_fwd/bf16_b64_h12_s1024_d64_bshd attention_bwd/bf16_b64_h12_s1024_d64_bshd attention_bwd/bf16_b4_h32_hk8 \
           attention_bwd/bf16_b4_h16_s2048_d128; do
    $B/fusekit bench --filter "$f" --json $OUT/c_$(echo $f | tr '/' '_').json 2>&1 | grep -E "fused|dense|tma_dq" | grep -v "^ceiling"
  done
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  cmake -S python -B /tmp/pyb -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=/tmp/s10/pfx \
    -DPython_EXECUTABLE=$(which python3) > /tmp/pyb.log 2>&1 && cmake --build /tmp/pyb >> /tmp/pyb.log 2>&1 || { tail -30 /tmp/pyb.log; exit 1; }
  cp /tmp/pyb/_C*.so python/fusekit/
  export PYTHONPATH=$R/python:$R/python/tests:/tmp/site PYTHONUNBUFFERED=1
  step layers; python3 -m fusekit.bench --filter rms_norm --out $OUT 2>&1 | grep -o '"name": "[^"]*".*speedup_vs_compile": [0-9.]*' | sed 's/"eager_us.*compile_us"/ compile_us/'
fi
if [ "${PART:-a}" = d ]; then
  for f in attention_fwd/bf16_b64_h12_s1024_d64_bshd attention_bwd/bf16_b64_h12_s1024_d64_bshd attention_bwd/bf16_b4_h32_hk8; do
    $B/fusekit bench --filter "$f" --json $OUT/d_$(echo $f | tr '/' '_').json 2>&1 | grep -E "fused|dense" | grep -v "^ceiling"
  done
fi
step done
