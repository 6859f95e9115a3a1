// attention_backward on tensor cores: FlashAttention-2's algorithm with mma.sync m16n8k16 (bf16 or
// f16 operands, f32 accumulation), for sm_80 and later (on Hopper for what attention_sm90_bwd.cu
// does not take: deterministic mode, windows, softcap, D 96), head dims 64, 96 and 128, every
// AttentionOptions. Nothing of size [Sq, Sk] is stored. Its delta and dq conversion kernels also
// run around the sm_90 backward (attention_backward_prologue, attention_backward_dq_from_accum).
//
// Three launches (four with dq_accum's memset):
//  1. delta = rowsum(dout ⊙ out) in f32, a warp per query row.
//  2. dk/dv: a CTA per (batch, k/v head, block of 128 keys), 8 warps of 16 keys each. K and V stay
//     in shared memory; the CTA walks the query blocks (64 rows) of every q head of its group that
//     can see one of its keys (fully masked blocks skipped), Q, dO, lse and delta double-buffered by
//     cp.async. Per block, in halves of 32 queries so that the registers hold: Sᵀ = K Qᵀ and
//     dPᵀ = V dOᵀ for the warp's keys, P = exp(s - lse) (s = scale q·k, softcapped), dS = P ⊙
//     (dP - delta) ⊙ s' · scale (s' = 1 - tanh² of the softcap), then dV += Pᵀ dO and dK += dSᵀ Q
//     with Pᵀ and dSᵀ straight from the accumulators (the m16n8 accumulator layout is the m16k16
//     operand layout). dK and dV, summed over the group, are written once at the end (overwritten).
//     Default mode: dSᵀ also goes to shared memory and the CTA adds dQ += dS K into an f32
//     dq_accum [B, H, Sq, D] by atomics (then 3. converts it to the dtype): fast, not bitwise
//     reproducible. Deterministic mode (AttentionOptions::deterministic): no dq here, and
//  3. dq: a CTA per (batch, q head, block of 64 queries), 4 warps of 16 queries, walking the visible
//     key blocks in order: S, dP, dS recomputed, dQ += dS K in registers, written once.
// P and dS are rounded to the input dtype before their GEMMs, as in FlashAttention. lse is the
// forward's natural-log log-sum-exp. Shared rows are padded by 16 bytes, so the eight rows an
// ldmatrix reads fall in eight different bank groups.
// Dense [B, H, S, D] and packed (varlen) batches alike (attention_layout.cuh, a template parameter
// kPacked): a CTA reads its sequence's place and lengths, the grid spans max_seqlen, and CTAs past
// their sequence's keys (dk/dv) or queries (dq) leave at once; tiles read from global memory with
// the layout's row stride (D dense, H D or Hk D packed) and zero-fill past the sequence's end, so a
// tile never sees the next sequence's tokens.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "attention_cuda.hpp"
#include "attention_layout.cuh"
#include "fusekit/core/cuda_check.hpp"
#include "ops/common/cuda_common.cuh"
#include "ops/common/mma_sm80.cuh"

namespace fk::cuda {
namespace {

constexpr int kBlockKeys = 128;                // Bc, keys of a dk/dv CTA
constexpr int kBlockQueries = 64;              // Br, queries a dk/dv CTA takes per step
constexpr int kQueryChunk = 32;                // queries of one Sᵀ/dPᵀ pass in registers
constexpr int kThreadsKv = kBlockKeys / 16 * 32;  // a warp per 16 keys
constexpr int kDqQueries = 64, kDqKeys = 64;   // the deterministic dq kernel's tiles
constexpr int kThreadsDq = kDqQueries / 16 * 32;
constexpr int kPad = 8;                        // elements (16 bytes) of padding per shared row
constexpr float kLog2e = 1.4426950408889634f;

// Which keys each query sees: j visible to i iff -left <= j - i - offset <= right (a bound < 0:
// unbounded), i < sq, j < sk (AttentionOptions' rule with right = 0 when causal).
struct Mask {
  int sq, sk;
  long long offset, left, right;

  __device__ bool visible(int i, int j) const {
    if (i >= sq || j >= sk) return false;
    const long long d = static_cast<long long>(j) - i - offset;
    return (left < 0 || d >= -left) && (right < 0 || d <= right);
  }
  // Every (i, j) of [i0, i0 + ni) x [j0, j0 + nj) visible: the tile needs no mask.
  __device__ bool all_visible(int i0, int ni, int j0, int nj) const {
    if (i0 + ni > sq || j0 + nj > sk) return false;
    const long long dmin = static_cast<long long>(j0) - (i0 + ni - 1) - offset;
    const long long dmax = static_cast<long long>(j0 + nj - 1) - i0 - offset;
    return (left < 0 || dmin >= -left) && (right < 0 || dmax <= right);
  }
  // Queries [begin, end) among which are all that see a key of [j0, j1).
  __device__ void queries_of(int j0, int j1, int& begin, int& end) const {
    long long b = 0, e = sq;
    if (right >= 0) b = max(b, j0 - offset - right);
    if (left >= 0) e = min(e, j1 - offset + left);
    begin = static_cast<int>(min(b, static_cast<long long>(sq)));
    end = static_cast<int>(max(e, static_cast<long long>(begin)));
  }
  // Keys [begin, end) among which are all that a query of [i0, i1) sees.
  __device__ void keys_of(int i0, int i1, int& begin, int& end) const {
    long long b = 0, e = sk;
    if (left >= 0) b = max(b, i0 + offset - left);
    if (right >= 0) e = min(e, i1 + offset + right);
    begin = static_cast<int>(min(b, static_cast<long long>(sk)));
    end = static_cast<int>(max(e, static_cast<long long>(begin)));
  }
};

// Shapes dense / packed (attention_layout.cuh).
template <class T>
struct BwdParams {
  const T* q;           // [B, H, Sq, D] / [total_q, H, D]
  const T* k;           // [B, Hk, Sk, D] / [total_k, Hk, D]
  const T* v;           // like k
  const T* out;         // like q
  const T* dout;        // like q
  const float* lse;     // [B, H, Sq] / [H, total_q], natural log
  float* delta;         // like lse, rowsum(dout ⊙ out)
  float* dq_accum;      // like q, f32, zeroed; the dk/dv kernel adds dq into it (default mode)
  T* dq;                // like q
  T* dk;                // like k
  T* dv;                // like k
  int heads, kv_heads;  // H, Hk
  float scale, softcap;
  Layout layout;
  Mask mask;          // dense: the call's; packed: left and right only (sq, sk, offset are per sequence)
  bool bottom_right;  // packed: a sequence's offset is its Sk - Sq
};

// The mask of one sequence: dense, the call's (read from the kernel parameters, as the dense
// kernels always did); packed, AttentionOptions' rule with the sequence's own Sq and Sk.
template <bool kPacked, class T>
__device__ __forceinline__ Mask mask_of(const BwdParams<T>& p, const SeqRows<kPacked>& seq) {
  if constexpr (kPacked)
    return Mask{static_cast<int>(seq.sq), static_cast<int>(seq.sk), p.bottom_right ? seq.sk - seq.sq : 0,
                p.mask.left, p.mask.right};
  else
    return p.mask;
}

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, zero-filled when !valid (src is then only a valid address, unread).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p))
               : "memory");
}

using device::mma;  // ops/common/mma_sm80.cuh
using device::pack2;

template <class T>
__device__ __forceinline__ float to_f32(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else return __half2float(x);
}

// Fragment addresses (lane -> the row its ldmatrix x4 supplies), tiles stored row-major with
// leading dimension ld. a_*: the m16k16 A operand at (m0, k0); b_*: two n8k16 B operands at
// (k0, n0) and (k0, n0 + 8), registers {b0, b1} of the first then of the second.
// a_rowmajor: A stored [m][k]. b_nk: B stored [n][k] (Bᵀ row-major). Then the .trans forms:
// a_km: A stored [k][m]; b_kn: B stored [k][n].
template <class T>
__device__ __forceinline__ const T* a_rowmajor(const T* s, int ld, int m0, int k0, int lane) {
  return s + (m0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ld + k0 + 8 * (lane >> 4);
}
template <class T>
__device__ __forceinline__ const T* b_nk(const T* s, int ld, int k0, int n0, int lane) {
  return s + (n0 + (lane & 7) + 8 * (lane >> 4)) * ld + k0 + 8 * ((lane >> 3) & 1);
}
template <class T>
__device__ __forceinline__ const T* a_km(const T* s, int ld, int m0, int k0, int lane) {
  return s + (k0 + (lane & 7) + 8 * (lane >> 4)) * ld + m0 + 8 * ((lane >> 3) & 1);
}
template <class T>
__device__ __forceinline__ const T* b_kn(const T* s, int ld, int k0, int n0, int lane) {
  return s + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ld + n0 + 8 * (lane >> 4);
}

// rows x D elements from g (row stride g_ld elements) into s (row stride D + kPad); rows >=
// valid_rows read as 0.
template <class T, int D, int Rows, int Threads>
__device__ __forceinline__ void load_tile(T* s, const T* g, std::int64_t g_ld, int valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row
  static_assert(Rows * kChunks % Threads == 0);
#pragma unroll
  for (int it = 0; it < Rows * kChunks / Threads; ++it) {
    const int c = it * Threads + static_cast<int>(threadIdx.x);
    const int r = c / kChunks, col = c % kChunks * 8;
    const bool ok = r < valid_rows;
    cp_async16(s + r * (D + kPad) + col, ok ? g + r * g_ld + col : g, ok);
  }
}

// The softmax's backward at one score: from the raw accumulator q·k and dp = dout·v, p (returned
// through acc) and dS · scale (through dp); p = 0 and dS = 0 where !visible.
__device__ __forceinline__ void score_grad(float& acc, float& dp, float lse, float delta, bool visible, float scale,
                                           float softcap) {
  const float raw = acc * scale;
  float s = raw, slope = 1.0f;
  if (softcap > 0.0f) {
    const float th = tanhf(raw / softcap);
    s = softcap * th;
    slope = 1.0f - th * th;
  }
  const float p = visible ? exp2f((s - lse) * kLog2e) : 0.0f;  // lse = -inf only where nothing is visible
  acc = p;
  dp = p * (dp - delta) * slope * scale;
}

// delta = rowsum(out ⊙ dout): kLanes lanes a row (one 16-byte load of each tensor a lane when D <= 8
// kLanes), 256 / kLanes rows a block; rows of out and dout (dense: row (b H + h) Sq + i; packed:
// token H + h) placed by their own strides; delta in lse's layout (packed: [H, total_q]).
template <class T, bool kPacked, int kLanes>
__global__ void __launch_bounds__(256)
    attention_bwd_delta_kernel(const T* __restrict__ out, const RowOffsets out_rows, const T* __restrict__ dout,
                               const RowOffsets dout_rows, float* __restrict__ delta, std::int64_t rows, int d,
                               std::int64_t heads, std::int64_t total_q) {
  static_assert(kLanes == 8 || kLanes == 16 || kLanes == 32);
  const int sub = static_cast<int>(threadIdx.x % kLanes);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (256 / kLanes) + threadIdx.x / kLanes;
  const bool live = row < rows;  // every lane stays for the shuffles
  float s = 0.0f;
  if (live) {
    const T* out_row = out + out_rows.at(row);
    const T* dout_row = dout + dout_rows.at(row);
    for (int c = sub * 8; c < d; c += kLanes * 8) {  // d % 8 == 0, 16-byte aligned rows
      const uint4 o = *reinterpret_cast<const uint4*>(out_row + c);
      const uint4 g = *reinterpret_cast<const uint4*>(dout_row + c);
      const T* oe = reinterpret_cast<const T*>(&o);
      const T* ge = reinterpret_cast<const T*>(&g);
#pragma unroll
      for (int e = 0; e < 8; ++e) s = fmaf(to_f32(oe[e]), to_f32(ge[e]), s);
    }
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (live && sub == 0) delta[kPacked ? row % heads * total_q + row / heads : row] = s;
}

template <class T, bool kPacked>
void launch_delta(const T* out, const RowOffsets& out_rows, const T* dout, const RowOffsets& dout_rows, float* delta,
                  std::int64_t rows, int d, std::int64_t heads, std::int64_t total_q, cudaStream_t s) {
  auto go = [&]<int kLanes>() {
    const auto blocks = static_cast<unsigned>((rows + 256 / kLanes - 1) / (256 / kLanes));
    attention_bwd_delta_kernel<T, kPacked, kLanes>
        <<<blocks, 256, 0, s>>>(out, out_rows, dout, dout_rows, delta, rows, d, heads, total_q);
  };
  if (d <= 64) go.template operator()<8>();
  else if (d <= 128) go.template operator()<16>();
  else go.template operator()<32>();
  FK_CUDA_CHECK_LAUNCH("attention_bwd_delta_kernel");
}

// dq (its rows placed by its strides) = the contiguous f32 accumulator rounded, 4 elements a thread
// (d % 4 == 0: they share a row).
template <class T>
__global__ void __launch_bounds__(256)
    attention_bwd_dq_convert_kernel(const float* __restrict__ acc, T* __restrict__ dq, const RowOffsets dq_rows,
                                    int d, std::int64_t n4) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(acc)[i];
    uint2 r;
    r.x = pack2<T>(a.x, a.y);
    r.y = pack2<T>(a.z, a.w);
    if (dq_rows.contiguous) {
      reinterpret_cast<uint2*>(dq)[i] = r;
    } else {
      const std::int64_t row = n4 <= UINT32_MAX ? static_cast<std::uint32_t>(i) / static_cast<std::uint32_t>(d / 4)
                                                : i / (d / 4);
      *reinterpret_cast<uint2*>(dq + dq_rows.at(row) + 4 * (i - row * (d / 4))) = r;
    }
  }
}

template <int D, bool kAtomicDq>
constexpr int dkdv_smem_bytes() {
  return 2 * (2 * kBlockKeys + 4 * kBlockQueries) * (D + kPad) +          // K, V; Q, dO twice
         (kAtomicDq ? 2 * kBlockKeys * (kBlockQueries + kPad) : 0) +     // dSᵀ
         2 * 2 * kBlockQueries * static_cast<int>(sizeof(float));        // lse, delta twice
}

template <class T, int D, bool kAtomicDq, bool kPacked>
__global__ void __launch_bounds__(kThreadsKv, 1) attention_bwd_dkdv_kernel(const BwdParams<T> p) {
  static_assert(D % 32 == 0 && D <= 128, "the accumulators of D > 128 do not fit the registers");
  constexpr int kLd = D + kPad, kLdS = kBlockQueries + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);            // (Bc, D) of row stride kLd
  T* vs = ks + kBlockKeys * kLd;                 // (Bc, D)
  T* qs = vs + kBlockKeys * kLd;                 // (2, Br, D)
  T* dos = qs + 2 * kBlockQueries * kLd;         // (2, Br, D)
  T* dsts = dos + 2 * kBlockQueries * kLd;       // dSᵀ (Bc, Br) of row stride kLdS, default mode only
  float* lses = reinterpret_cast<float*>(dsts + (kAtomicDq ? kBlockKeys * kLdS : 0));  // (2, Br)
  float* deltas = lses + 2 * kBlockQueries;      // (2, Br)

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int j0 = static_cast<int>(blockIdx.x) * kBlockKeys;
  const int bkh = static_cast<int>(blockIdx.y);  // b * Hk + kv head
  // kvh = bkh - b Hk (not bkh % Hk), so that the dense rows' b Hk + kvh folds back to bkh.
  const std::int64_t b = bkh / p.kv_heads, kvh = bkh - b * p.layout.kv_heads;
  const int group = p.heads / p.kv_heads, h0 = static_cast<int>(kvh) * group;
  const auto seq = p.layout.template seq<kPacked>(b);
  if constexpr (kPacked)
    if (j0 >= seq.sk) return;  // past this sequence's keys: no rows of dk and dv here
  const Mask seq_mask = mask_of<kPacked>(p, seq);
  const Mask& mask = kPacked ? seq_mask : p.mask;  // dense: the kernel parameter, as always
  const std::int64_t q_ld = seq.q_tok() * D, kv_ld = seq.kv_tok() * D;  // row strides in global memory
  const int keys_here = min(kBlockKeys, mask.sk - j0);

  int q_begin, q_end;
  mask.queries_of(j0, j0 + keys_here, q_begin, q_end);
  const int qb0 = q_begin / kBlockQueries;
  const int blocks_per_head = q_begin < q_end ? (q_end + kBlockQueries - 1) / kBlockQueries - qb0 : 0;
  const int steps = group * blocks_per_head;
  const int kr0 = warp * 16;  // the warp's keys in the block

  float dk_acc[D / 8][4], dv_acc[D / 8][4];  // (16 keys, D): rows g and g + 8, columns 8n + 2t, +1
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;

  if (steps > 0) {
    const std::int64_t kv_row0 = seq.kv_row(kvh, j0);
    load_tile<T, D, kBlockKeys, kThreadsKv>(ks, p.k + kv_row0 * D, kv_ld, keys_here);
    load_tile<T, D, kBlockKeys, kThreadsKv>(vs, p.v + kv_row0 * D, kv_ld, keys_here);
  }
  // Step s: q head h0 + s / blocks_per_head, queries from (qb0 + s % blocks_per_head) Br.
  auto step_head = [&](int s) { return h0 + s / blocks_per_head; };
  auto step_i0 = [&](int s) { return (qb0 + s % blocks_per_head) * kBlockQueries; };
  auto load_step = [&](int s, int buf) {
    const int i0 = step_i0(s), h = step_head(s);
    const std::int64_t row0 = seq.q_row(h, i0), stat0 = seq.stat(h, i0);  // i0 < Sq: valid addresses
    load_tile<T, D, kBlockQueries, kThreadsKv>(qs + buf * kBlockQueries * kLd, p.q + row0 * D, q_ld, mask.sq - i0);
    load_tile<T, D, kBlockQueries, kThreadsKv>(dos + buf * kBlockQueries * kLd, p.dout + row0 * D, q_ld,
                                               mask.sq - i0);
    for (int r = static_cast<int>(threadIdx.x); r < kBlockQueries; r += kThreadsKv) {
      const bool ok = i0 + r < mask.sq;
      cp_async4(lses + buf * kBlockQueries + r, p.lse + stat0 + (ok ? r : 0), ok);
      cp_async4(deltas + buf * kBlockQueries + r, p.delta + stat0 + (ok ? r : 0), ok);
    }
  };
  if (steps > 0) load_step(0, 0);
  cp_async_commit();

  for (int s = 0; s < steps; ++s) {
    const int buf = s & 1;
    cp_async_wait_all();
    __syncthreads();  // step s's tiles are in; every warp is done with the other buffer and with dSᵀ
    if (s + 1 < steps) load_step(s + 1, buf ^ 1);
    cp_async_commit();

    const int i0 = step_i0(s);
    const T* qt = qs + buf * kBlockQueries * kLd;
    const T* dot = dos + buf * kBlockQueries * kLd;
    const float* lset = lses + buf * kBlockQueries;
    const float* deltat = deltas + buf * kBlockQueries;
    const bool full = mask.all_visible(i0, kBlockQueries, j0, kBlockKeys);

#pragma unroll 1
    for (int c0 = 0; c0 < kBlockQueries; c0 += kQueryChunk) {
      // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: (16 keys, 32 queries) each.
      float st[kQueryChunk / 8][4], dpt[kQueryChunk / 8][4];
#pragma unroll
      for (int n = 0; n < kQueryChunk / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        std::uint32_t ka[4], va[4];
        ldmatrix_x4(ka, a_rowmajor(ks, kLd, kr0, kk * 16, lane));
        ldmatrix_x4(va, a_rowmajor(vs, kLd, kr0, kk * 16, lane));
#pragma unroll
        for (int n = 0; n < kQueryChunk / 16; ++n) {
          std::uint32_t qb[4], ob[4];
          ldmatrix_x4(qb, b_nk(qt, kLd, kk * 16, c0 + n * 16, lane));
          ldmatrix_x4(ob, b_nk(dot, kLd, kk * 16, c0 + n * 16, lane));
          mma<T>(st[2 * n], ka, qb[0], qb[1]);
          mma<T>(st[2 * n + 1], ka, qb[2], qb[3]);
          mma<T>(dpt[2 * n], va, ob[0], ob[1]);
          mma<T>(dpt[2 * n + 1], va, ob[2], ob[3]);
        }
      }
      // P and dS; element e of tile n: key kr0 + g + 8 (e / 2), query c0 + 8n + 2t + e % 2.
#pragma unroll
      for (int n = 0; n < kQueryChunk / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kr0 + g + 8 * (e >> 1), qi = c0 + 8 * n + 2 * t + (e & 1);
          const bool vis = full || mask.visible(i0 + qi, j0 + key);
          score_grad(st[n][e], dpt[n][e], lset[qi], deltat[qi], vis, p.scale, p.softcap);
        }
      // Pᵀ and dSᵀ as A operands (16 keys, k = 16 queries each).
      std::uint32_t pa[kQueryChunk / 16][4], dsa[kQueryChunk / 16][4];
#pragma unroll
      for (int kk = 0; kk < kQueryChunk / 16; ++kk) {
        pa[kk][0] = pack2<T>(st[2 * kk][0], st[2 * kk][1]);
        pa[kk][1] = pack2<T>(st[2 * kk][2], st[2 * kk][3]);
        pa[kk][2] = pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]);
        pa[kk][3] = pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3]);
        dsa[kk][0] = pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]);
        dsa[kk][1] = pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]);
        dsa[kk][2] = pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
        dsa[kk][3] = pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
      }
      // dV += Pᵀ dO, dK += dSᵀ Q.
#pragma unroll
      for (int kk = 0; kk < kQueryChunk / 16; ++kk)
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
          std::uint32_t ob[4], qb[4];
          ldmatrix_x4_trans(ob, b_kn(dot, kLd, c0 + kk * 16, n * 16, lane));
          ldmatrix_x4_trans(qb, b_kn(qt, kLd, c0 + kk * 16, n * 16, lane));
          mma<T>(dv_acc[2 * n], pa[kk], ob[0], ob[1]);
          mma<T>(dv_acc[2 * n + 1], pa[kk], ob[2], ob[3]);
          mma<T>(dk_acc[2 * n], dsa[kk], qb[0], qb[1]);
          mma<T>(dk_acc[2 * n + 1], dsa[kk], qb[2], qb[3]);
        }
      if constexpr (kAtomicDq) {
        // dSᵀ rows kr0 + g (registers 0, 2) and kr0 + g + 8 (1, 3), columns c0 + 16kk + 2t (+ 8).
#pragma unroll
        for (int kk = 0; kk < kQueryChunk / 16; ++kk) {
          T* lo = dsts + (kr0 + g) * kLdS + c0 + 16 * kk + 2 * t;
          T* hi = lo + 8 * kLdS;
          *reinterpret_cast<std::uint32_t*>(lo) = dsa[kk][0];
          *reinterpret_cast<std::uint32_t*>(hi) = dsa[kk][1];
          *reinterpret_cast<std::uint32_t*>(lo + 8) = dsa[kk][2];
          *reinterpret_cast<std::uint32_t*>(hi + 8) = dsa[kk][3];
        }
      }
    }

    if constexpr (kAtomicDq) {
      __syncthreads();  // every warp's dSᵀ is in
      // dQ (Br, D) += dS (Br, Bc) K (Bc, D): warp w takes queries 16 (w % 4), columns (w / 4) D / 2.
      static_assert(kThreadsKv / 32 == 2 * kBlockQueries / 16);
      constexpr int kCols = D / 2;
      const int m0 = 16 * (warp & 3), n0 = (warp >> 2) * kCols;
      float acc[kCols / 8][4];
#pragma unroll
      for (int n = 0; n < kCols / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kBlockKeys / 16; ++kk) {
        std::uint32_t a[4];
        ldmatrix_x4_trans(a, a_km(dsts, kLdS, m0, kk * 16, lane));
#pragma unroll
        for (int n = 0; n < kCols / 16; ++n) {
          std::uint32_t kb[4];
          ldmatrix_x4_trans(kb, b_kn(ks, kLd, kk * 16, n0 + n * 16, lane));
          mma<T>(acc[2 * n], a, kb[0], kb[1]);
          mma<T>(acc[2 * n + 1], a, kb[2], kb[3]);
        }
      }
      float* dqa = p.dq_accum + seq.q_row(step_head(s), i0) * D;
#pragma unroll
      for (int n = 0; n < kCols / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = m0 + g + 8 * (e >> 1), col = n0 + 8 * n + 2 * t + (e & 1);
          if (i0 + row < mask.sq) atomicAdd(dqa + row * q_ld + col, acc[n][e]);
        }
    }
  }

  // dK and dV, keys j0 + kr0 + g (+ 8).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = kr0 + g + 8 * half;
    if (row >= keys_here) continue;
    T* dkr = p.dk + seq.kv_row(kvh, j0 + row) * D;
    T* dvr = p.dv + seq.kv_row(kvh, j0 + row) * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<std::uint32_t*>(dkr + 8 * n + 2 * t) = pack2<T>(dk_acc[n][2 * half], dk_acc[n][2 * half + 1]);
      *reinterpret_cast<std::uint32_t*>(dvr + 8 * n + 2 * t) = pack2<T>(dv_acc[n][2 * half], dv_acc[n][2 * half + 1]);
    }
  }
}

template <int D>
constexpr int dq_smem_bytes() {
  return 2 * (2 * kDqQueries + 4 * kDqKeys) * (D + kPad);  // Q, dO; K, V twice
}

// Deterministic mode's dq: a CTA per (batch, q head, 64 queries), its visible key blocks in order.
template <class T, int D, bool kPacked>
__global__ void __launch_bounds__(kThreadsDq) attention_bwd_dq_kernel(const BwdParams<T> p) {
  constexpr int kLd = D + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);       // (Br, D)
  T* dos = qs + kDqQueries * kLd;           // (Br, D)
  T* ks = dos + kDqQueries * kLd;           // (2, Bc, D)
  T* vs = ks + 2 * kDqKeys * kLd;           // (2, Bc, D)

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int i0 = static_cast<int>(blockIdx.x) * kDqQueries;
  const int bh = static_cast<int>(blockIdx.y), group = p.heads / p.kv_heads;
  // h = bh - b H (not bh % H), so that the dense rows' b H + h folds back to bh.
  const std::int64_t b = bh / p.heads, h = bh - b * p.layout.heads;
  const int kvh = static_cast<int>(h) / group;
  const auto seq = p.layout.template seq<kPacked>(b);
  if constexpr (kPacked)
    if (i0 >= seq.sq) return;  // past this sequence's queries
  const Mask seq_mask = mask_of<kPacked>(p, seq);
  const Mask& mask = kPacked ? seq_mask : p.mask;  // dense: the kernel parameter, as always
  const int queries_here = min(kDqQueries, mask.sq - i0);
  const std::int64_t row0 = seq.q_row(h, i0), stat0 = seq.stat(h, i0);
  const std::int64_t q_ld = seq.q_tok() * D, kv_ld = seq.kv_tok() * D;  // row strides in global memory
  const int m0 = 16 * warp;

  int k_begin, k_end;
  mask.keys_of(i0, i0 + queries_here, k_begin, k_end);
  const int kb0 = k_begin / kDqKeys, kb1 = k_begin < k_end ? (k_end + kDqKeys - 1) / kDqKeys : kb0;

  float acc[D / 8][4];  // dQ (16 queries, D)
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;

  if (kb0 < kb1) {
    load_tile<T, D, kDqQueries, kThreadsDq>(qs, p.q + row0 * D, q_ld, queries_here);
    load_tile<T, D, kDqQueries, kThreadsDq>(dos, p.dout + row0 * D, q_ld, queries_here);
  }
  auto load_keys = [&](int kb, int buf) {
    const std::int64_t kv_row0 = seq.kv_row(kvh, kb * kDqKeys);
    load_tile<T, D, kDqKeys, kThreadsDq>(ks + buf * kDqKeys * kLd, p.k + kv_row0 * D, kv_ld, mask.sk - kb * kDqKeys);
    load_tile<T, D, kDqKeys, kThreadsDq>(vs + buf * kDqKeys * kLd, p.v + kv_row0 * D, kv_ld, mask.sk - kb * kDqKeys);
  };
  if (kb0 < kb1) load_keys(kb0, 0);
  cp_async_commit();
  float lse[2], delta[2];  // rows m0 + g, m0 + g + 8
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const bool ok = m0 + g + 8 * half < queries_here;
    lse[half] = ok ? p.lse[stat0 + m0 + g + 8 * half] : 0.0f;
    delta[half] = ok ? p.delta[stat0 + m0 + g + 8 * half] : 0.0f;
  }

  for (int kb = kb0; kb < kb1; ++kb) {
    const int buf = (kb - kb0) & 1;
    cp_async_wait_all();
    __syncthreads();  // block kb's keys are in; every warp is done with the other buffer
    if (kb + 1 < kb1) load_keys(kb + 1, buf ^ 1);
    cp_async_commit();
    const T* kt = ks + buf * kDqKeys * kLd;
    const T* vt = vs + buf * kDqKeys * kLd;
    const int j0 = kb * kDqKeys;
    const bool full = mask.all_visible(i0, kDqQueries, j0, kDqKeys);

    float s[kDqKeys / 8][4], dp[kDqKeys / 8][4];  // S = Q Kᵀ, dP = dO Vᵀ: (16 queries, 64 keys)
#pragma unroll
    for (int n = 0; n < kDqKeys / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t qa[4], oa[4];
      ldmatrix_x4(qa, a_rowmajor(qs, kLd, m0, kk * 16, lane));
      ldmatrix_x4(oa, a_rowmajor(dos, kLd, m0, kk * 16, lane));
#pragma unroll
      for (int n = 0; n < kDqKeys / 16; ++n) {
        std::uint32_t kb_[4], vb[4];
        ldmatrix_x4(kb_, b_nk(kt, kLd, kk * 16, n * 16, lane));
        ldmatrix_x4(vb, b_nk(vt, kLd, kk * 16, n * 16, lane));
        mma<T>(s[2 * n], qa, kb_[0], kb_[1]);
        mma<T>(s[2 * n + 1], qa, kb_[2], kb_[3]);
        mma<T>(dp[2 * n], oa, vb[0], vb[1]);
        mma<T>(dp[2 * n + 1], oa, vb[2], vb[3]);
      }
    }
    // Element e of tile n: query m0 + g + 8 (e / 2), key 8n + 2t + e % 2.
#pragma unroll
    for (int n = 0; n < kDqKeys / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = m0 + g + 8 * (e >> 1), key = 8 * n + 2 * t + (e & 1);
        const bool vis = full || mask.visible(i0 + qi, j0 + key);
        score_grad(s[n][e], dp[n][e], lse[e >> 1], delta[e >> 1], vis, p.scale, p.softcap);
      }
    // dQ += dS K, dS as A operands (16 queries, k = 16 keys each).
#pragma unroll
    for (int kk = 0; kk < kDqKeys / 16; ++kk) {
      const std::uint32_t dsa[4] = {pack2<T>(dp[2 * kk][0], dp[2 * kk][1]), pack2<T>(dp[2 * kk][2], dp[2 * kk][3]),
                                    pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                    pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        std::uint32_t kb_[4];
        ldmatrix_x4_trans(kb_, b_kn(kt, kLd, kk * 16, n * 16, lane));
        mma<T>(acc[2 * n], dsa, kb_[0], kb_[1]);
        mma<T>(acc[2 * n + 1], dsa, kb_[2], kb_[3]);
      }
    }
  }
  cp_async_wait_all();

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = m0 + g + 8 * half;
    if (row >= queries_here) continue;
    T* dqr = p.dq + row0 * D + row * q_ld;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<std::uint32_t*>(dqr + 8 * n + 2 * t) = pack2<T>(acc[n][2 * half], acc[n][2 * half + 1]);
  }
}

int max_optin_smem(int device) {
  int bytes = 0;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

// rows: the rows of out (B H Sq dense; total_q H packed, 0 when every sequence is without queries,
// which still writes dk = dv = 0).
template <class T, int D, bool kPacked>
void launch(const BwdParams<T>& p, const RowOffsets& contiguous, std::int64_t rows, bool deterministic,
            cudaStream_t s) {
  const Layout& L = p.layout;
  if (rows > 0) {
    launch_delta<T, kPacked>(p.out, contiguous, p.dout, contiguous, p.delta, rows, D, L.heads, L.total_q, s);
  }
  const dim3 kv_grid(static_cast<unsigned>((L.sk + kBlockKeys - 1) / kBlockKeys),
                     static_cast<unsigned>(L.batch * L.kv_heads));
  if (deterministic) {
    constexpr int kv_bytes = dkdv_smem_bytes<D, false>(), dq_bytes = dq_smem_bytes<D>();
    FK_CUDA_CHECK(cudaFuncSetAttribute(attention_bwd_dkdv_kernel<T, D, false, kPacked>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kv_bytes));
    attention_bwd_dkdv_kernel<T, D, false, kPacked><<<kv_grid, kThreadsKv, kv_bytes, s>>>(p);
    FK_CUDA_CHECK_LAUNCH("attention_bwd_dkdv_kernel");
    FK_CUDA_CHECK(cudaFuncSetAttribute(attention_bwd_dq_kernel<T, D, kPacked>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, dq_bytes));
    const dim3 q_grid(static_cast<unsigned>((L.sq + kDqQueries - 1) / kDqQueries),
                      static_cast<unsigned>(L.batch * L.heads));
    attention_bwd_dq_kernel<T, D, kPacked><<<q_grid, kThreadsDq, dq_bytes, s>>>(p);
    FK_CUDA_CHECK_LAUNCH("attention_bwd_dq_kernel");
  } else {
    constexpr int kv_bytes = dkdv_smem_bytes<D, true>();
    if (rows > 0) FK_CUDA_CHECK(cudaMemsetAsync(p.dq_accum, 0, static_cast<std::size_t>(rows) * D * sizeof(float), s));
    FK_CUDA_CHECK(cudaFuncSetAttribute(attention_bwd_dkdv_kernel<T, D, true, kPacked>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kv_bytes));
    attention_bwd_dkdv_kernel<T, D, true, kPacked><<<kv_grid, kThreadsKv, kv_bytes, s>>>(p);
    FK_CUDA_CHECK_LAUNCH("attention_bwd_dkdv_kernel");
    if (rows > 0) {
      const std::int64_t n4 = rows * D / 4;
      const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((n4 + 255) / 256, 8 * multiprocessor_count()));
      attention_bwd_dq_convert_kernel<T><<<blocks, 256, 0, s>>>(p.dq_accum, p.dq, contiguous, D, n4);
      FK_CUDA_CHECK_LAUNCH("attention_bwd_dq_convert_kernel");
    }
  }
}

template <int D>
int smem_needed(bool deterministic) {
  return deterministic ? std::max(dkdv_smem_bytes<D, false>(), dq_smem_bytes<D>()) : dkdv_smem_bytes<D, true>();
}

}  // namespace

bool attention_backward_mma(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& dout, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                            const TensorView& dv, const TensorView& delta, const TensorView& dq_accum,
                            const AttentionVarlen* varlen, const AttentionOptions& opt, const Stream* stream) {
  const DType t = q.dtype();
  const std::int64_t d = q.size(q.rank() - 1), rows = q.numel() / d;
  if (!attention_backward_mma_supports(q, k, varlen)) return false;
  for (const TensorView* x : {&q, &k, &v, &out, &dout, &dq, &dk, &dv, &dq_accum})
    if (!aligned16(x->data())) return false;
  const int device = q.device().index;
  fk::detail::DeviceScope on_device(device);
  int major = 0;
  FK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 8) return false;
  const int need = d == 64 ? smem_needed<64>(opt.deterministic)
                   : d == 96 ? smem_needed<96>(opt.deterministic)
                             : smem_needed<128>(opt.deterministic);
  if (need > max_optin_smem(device)) return false;

  const Layout L = layout_of(q, k, varlen);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  with_float_type(t, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (!std::is_same_v<T, float>) {
      const BwdParams<T> p{q.data_as<T>(),        k.data_as<T>(),     v.data_as<T>(),
                           out.data_as<T>(),      dout.data_as<T>(),  lse.data_as<float>(),
                           delta.data_as<float>(), dq_accum.data_as<float>(), dq.data_as<T>(),
                           dk.data_as<T>(),       dv.data_as<T>(),    static_cast<int>(L.heads),
                           static_cast<int>(L.kv_heads), opt.scale, opt.softcap, L,
                           Mask{static_cast<int>(L.sq), static_cast<int>(L.sk), opt.bottom_right ? L.sk - L.sq : 0,
                                opt.window_left, opt.causal ? 0 : opt.window_right},
                           opt.bottom_right};
      auto run = [&](auto packed) {
        constexpr bool kPacked = decltype(packed)::value;
        const RowOffsets contiguous = row_offsets(q);  // q, out, dout and dq: one contiguous layout
        if (d == 64) launch<T, 64, kPacked>(p, contiguous, rows, opt.deterministic, s);
        else if (d == 96) launch<T, 96, kPacked>(p, contiguous, rows, opt.deterministic, s);
        else launch<T, 128, kPacked>(p, contiguous, rows, opt.deterministic, s);
      };
      if (varlen) run(std::true_type{});
      else run(std::false_type{});
    }
  });
  return true;
}

void attention_backward_prologue(const TensorView& out, const TensorView& dout, const TensorView& delta,
                                 const TensorView& dq_accum, const Stream* stream) {
  const bool packed = out.rank() == 3;
  const std::int64_t d = packed ? out.size(2) : out.size(3), rows = out.numel() / d;
  if (rows == 0) return;
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  with_float_type(out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    if constexpr (!std::is_same_v<T, float>) {
      // packed: out's row token H + h, delta's element h total_q + token
      const RowOffsets out_rows = row_offsets(out), dout_rows = row_offsets(dout);
      if (packed)
        launch_delta<T, true>(out.data_as<T>(), out_rows, dout.data_as<T>(), dout_rows, delta.data_as<float>(), rows,
                              static_cast<int>(d), out.size(1), out.size(0), s);
      else
        launch_delta<T, false>(out.data_as<T>(), out_rows, dout.data_as<T>(), dout_rows, delta.data_as<float>(), rows,
                               static_cast<int>(d), 1, 0, s);
    }
  });
  FK_CUDA_CHECK(cudaMemsetAsync(dq_accum.data(), 0, static_cast<std::size_t>(rows * d) * sizeof(float), s));
}

void attention_backward_dq_from_accum(const TensorView& dq_accum, const TensorView& dq, const Stream* stream) {
  const std::int64_t n4 = dq.numel() / 4, d = dq.rank() == 3 ? dq.size(2) : dq.size(3);
  if (n4 == 0) return;
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  with_float_type(dq.dtype(), [&](auto zero) {
    using T = decltype(zero);
    if constexpr (!std::is_same_v<T, float>) {
      const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((n4 + 255) / 256, 8 * multiprocessor_count()));
      attention_bwd_dq_convert_kernel<T><<<blocks, 256, 0, s>>>(dq_accum.data_as<float>(), dq.data_as<T>(),
                                                                row_offsets(dq), static_cast<int>(d), n4);
      FK_CUDA_CHECK_LAUNCH("attention_bwd_dq_convert_kernel");
    }
  });
}

bool attention_backward_mma_supports(const TensorView& q, const TensorView& k, const AttentionVarlen* varlen) {
  const DType t = q.dtype();
  const std::int64_t d = q.size(q.rank() - 1);
  if ((t != DType::bf16 && t != DType::f16) || (d != 64 && d != 96 && d != 128)) return false;
  // 32-bit query and key indices inside the kernels; B * H within the grid's y extent, and >= 1.
  const Layout L = layout_of(q, k, varlen);
  if (L.sq < 1 || L.sk < 1 || L.sq > INT_MAX / 2 || L.sk > INT_MAX / 2) return false;
  const std::int64_t bh = L.batch * L.heads;
  return bh >= 1 && bh <= 65535;
}

}  // namespace fk::cuda
