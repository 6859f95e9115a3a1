// The fused GLU GEMM on Hopper: C = x wᵀ (+ b) on the tensor cores, the gated activation applied
// to the accumulators in registers, C never written.
//
// Mainloop: CUTLASS 3's SM90 TMA warp-specialized cooperative GEMM (the collective builder's
// choice of swizzles, stage count and persistent tile scheduler): x is the K-major A operand
// [M, K], the prepared w the K-major B operand [2N, K] ("TN", the tensor cores' native layout), a
// CTA tile of 128 x 256 outputs with two consumer warpgroups, no clusters (the ping-pong
// configuration for many tiles: 128 x 128 tiles, clusters of 2 along N sharing x by multicast).
//
// Epilogue (GluEpilogue below, in CUTLASS's no-shared-memory epilogue interface): a wgmma
// accumulator fragment holds, for every row a thread owns, columns in adjacent pairs (2j, 2j + 1).
// In the prepared layout those are L[m, j] and R[m, j], so each thread computes glu(l + b, r + b')
// from two of its own registers and stores one value: no shuffles, no shared memory, no [M, 2N]
// anything. (The bias is added by the epilogue in the ping-pong configuration; in the cooperative
// one the accumulators start at it, see GluBiasMainloop.) The forward's keeping variant also
// stores the pairs (l + b, r + b') themselves to preact [M, 2N] (prepared order, the same stores
// as the backward's dC, below), for a backward that reads them instead of recomputing the GEMM.
// The backward variant recomputes the same accumulators, reads dy[m, j] and stores the pair
// (dy dglu/dl, dy dglu/dr) to dC[m, 2j .. 2j + 1] with one 2-element store, and (when asked) the
// column sums of dC over each 16-row slab into db_partial [ceil(M / 16), 2N] (fp32, one writer
// per element, so db = its column sums is deterministic and dC is not read again).
//
// One kernel per (dtype, tile configuration, kind, direction: forward, forward keeping C,
// backward): the kind and the direction are template arguments, not run-time branches, so each
// kernel holds only the code it runs. A kernel holding all five kinds and both directions ran the
// small forwards slower whenever cuBLAS's TF32 GEMM had run before them, from its size alone
// (docs/notes/glu.md). Each kind's kernels are compiled in their own translation unit
// (glu_gemm_<kind>.cu), so the five build in parallel.
//
// This header is included only by those units; glu_gemm.cu picks the kernel at run time.
//
// f32 operands run as TF32 (the builder maps float to tfloat32_t: wgmma reads the top 19 bits).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "fusekit/core/tensor.hpp"
#include "glu_gemm_kinds.hpp"
#include "glu_math.cuh"
#include "ops/common/sm90_epilogue.cuh"
#include "ops/common/cuda_common.cuh"

namespace fk::cuda::glu_detail {

// The epilogue of kind Kind, forward or backward (kBackward). Arguments: the prepared bias (or
// null), the output (out [M, N] forward, dC [M, 2N] backward), dy [M, N] (backward only, else
// null), and (backward only, or null) db_partial [ceil(M / 16), 2N] fp32: row s gets the sums of
// dC's rows 16 s .. 16 s + 15. kBwdBranchPerStep: where the backward picks its vector or scalar
// path (see apply). kBiasHere: the epilogue adds the bias (the ping-pong configuration); the
// cooperative one's accumulators already start at it (GluBiasMainloop), and its epilogue ignores
// the bias. kSavePreact (forward only): also store C to preact [M, 2N].
template <class Element, bool kBwdBranchPerStep, GluKind Kind, bool kBackward, bool kBiasHere, bool kSavePreact>
class GluEpilogue : public sm90::NoSmemEpilogueBase<Element> {
 public:
  using Base = sm90::NoSmemEpilogueBase<Element>;
  using typename Base::ElementAccumulator;
  using typename Base::StrideC;
  using typename Base::StrideD;
  using typename Base::SharedStorage;

  struct Arguments {
    const Element* bias = nullptr;
    Element* out = nullptr;
    const Element* dy = nullptr;
    // N % 4 == 0 and out, dy, preact 16-byte aligned: whole groups of 4 outputs per store.
    bool vector_ok = false;
    float* db_partial = nullptr;
    int bias_len = 0;  // 2N
    Element* preact = nullptr;  // [M, 2N], kSavePreact only
  };
  using Params = Arguments;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.out != nullptr && (args.dy != nullptr) == kBackward && (args.preact != nullptr) == kSavePreact;
  }

  CUTLASS_HOST_DEVICE explicit GluEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {
#if defined(__CUDA_ARCH__)
    // The bias is read only in the epilogue, after the mainloop, where a miss to DRAM would sit
    // on every tile's critical path. So the grid
    // brings it into L2 at the start: one 128-byte line per thread across the grid, once.
    if (kBiasHere && params.bias != nullptr) {
      const int64_t lines = (static_cast<int64_t>(params.bias_len) * static_cast<int64_t>(sizeof(Element)) + 127) / 128;
      const int64_t g = (blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + gridDim.y * blockIdx.z)) * blockDim.x +
                        threadIdx.x;
      if (g < lines) asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(params.bias) + 128 * g));
    }
#endif
  }

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int m_total = static_cast<int>(get<0>(problem_shape_mnkl));
    const int n2_total = static_cast<int>(get<1>(problem_shape_mnkl));  // 2N, even
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    // The (m, n) coordinate of every accumulator this thread holds.
    cute::Tensor coords = local_tile(make_identity_tensor(make_shape(m_total, n2_total)), take<0, 2>(blk_shape_mnk),
                               make_coord(m_coord, n_coord));
    cute::Tensor t_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);
    static_assert(is_static<FrgLayout>::value, "glu epilogue: the accumulator layout must be static");
    CUTE_STATIC_ASSERT_V(size(t_coords) == size(acc));
    apply<Kind, kBackward>(acc, t_coords, m_total, n2_total);
  }

 private:

  // 4 x 4 transposes within each quad of lanes: afterwards lane q holds, as element p, what lane p
  // held as element q. 32-bit elements (4 words) or 16-bit ones (2 words, low half first).
  CUTLASS_DEVICE static void quad_transpose_u32(uint32_t (&w)[4]) {
    const int lane = threadIdx.x & 3;
    const bool b1 = (lane & 2) != 0, b0 = (lane & 1) != 0;
    uint32_t r0 = __shfl_xor_sync(0xffffffffu, b1 ? w[0] : w[2], 2);
    uint32_t r1 = __shfl_xor_sync(0xffffffffu, b1 ? w[1] : w[3], 2);
    if (b1) { w[0] = r0; w[1] = r1; } else { w[2] = r0; w[3] = r1; }
    r0 = __shfl_xor_sync(0xffffffffu, b0 ? w[0] : w[1], 1);
    r1 = __shfl_xor_sync(0xffffffffu, b0 ? w[2] : w[3], 1);
    if (b0) { w[0] = r0; w[2] = r1; } else { w[1] = r0; w[3] = r1; }
  }
  CUTLASS_DEVICE static void quad_transpose_u16(uint32_t (&w)[2]) {
    const int lane = threadIdx.x & 3;
    const bool b1 = (lane & 2) != 0, b0 = (lane & 1) != 0;
    const uint32_t r = __shfl_xor_sync(0xffffffffu, b1 ? w[0] : w[1], 2);
    if (b1) w[0] = r; else w[1] = r;
    // Lanes with b0 = 0 keep the low halves and send the high ones; b0 = 1 the reverse.
    const uint32_t got = __shfl_xor_sync(0xffffffffu, b0 ? __byte_perm(w[0], w[1], 0x5410)
                                                         : __byte_perm(w[0], w[1], 0x7632), 1);
    if (b0) {
      w[0] = __byte_perm(w[0], got, 0x3254);
      w[1] = __byte_perm(w[1], got, 0x3276);
    } else {
      w[0] = __byte_perm(w[0], got, 0x5410);
      w[1] = __byte_perm(w[1], got, 0x7610);
    }
  }
  CUTLASS_DEVICE static uint32_t pack2(float a, float b) {  // two 16-bit elements, a in the low half
    cutlass::Array<Element, 2> p;
    p[0] = Element(a);
    p[1] = Element(b);
    return reinterpret_cast<uint32_t const&>(p);
  }
  // Stores the pairs (a[c], b[c]) this lane holds for the 4 chunks c of a step: after a quad
  // transpose lane q owns chunk q's pairs of the quad's 4 lanes, 8 consecutive elements of a
  // [M, 2N] row from p. Every lane calls it (shuffles); `store` guards only the write.
  CUTLASS_DEVICE static void store_pairs(const float (&a)[4], const float (&b)[4], Element* p, bool store) {
    if constexpr (sizeof(Element) == 2) {
      uint32_t w[4];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 4; ++c) w[c] = pack2(a[c], b[c]);
      quad_transpose_u32(w);
      if (store) *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      uint32_t wl[4], wr[4];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 4; ++c) {
        wl[c] = __float_as_uint(a[c]);
        wr[c] = __float_as_uint(b[c]);
      }
      quad_transpose_u32(wl);
      quad_transpose_u32(wr);
      if (store) {
        reinterpret_cast<uint4*>(p)[0] = make_uint4(wl[0], wr[0], wl[1], wr[1]);
        reinterpret_cast<uint4*>(p)[1] = make_uint4(wl[2], wr[2], wl[3], wr[3]);
      }
    }
  }
  CUTLASS_DEVICE static float half_of(uint32_t w, int hi) {
    const uint16_t bits = static_cast<uint16_t>(hi ? w >> 16 : w & 0xffffu);
    return static_cast<float>(reinterpret_cast<Element const&>(bits));
  }

  // The accumulator fragment of a wgmma 64 x N tile, per thread: index i = c0 + 2 h + 4 c, where
  // c0 picks the column of a pair (2q + c0 of the 8-column chunk c, q = lane % 4) and h the row
  // (r or r + 8); a second 64-row block, if any, follows. So (i, i + 1) for even i is one (L, R)
  // pair, and chunks come in groups of four whose outputs the quad's lanes hold interleaved: lane q
  // has output columns 4c + q. A quad transpose turns that into 4 consecutive outputs per lane,
  // stored with one 8- or 16-byte access (a full 32-byte sector per quad) instead of four 2-byte
  // ones. One step handles one group and row half: 8 accumulators, 4 outputs.
  static constexpr int kVals = 128;     // accumulators a thread holds (128 x 256 tile, 2 warpgroups)
  static constexpr int kItersFwd = 2, kItersBwd = 4;  // cooperative configuration: see apply
  static constexpr int kChunks = kVals / 4;
  using Pair = cutlass::Array<Element, 2>;

  struct Step {
    float l[4], r[4];  // pre-activations of the 4 chunks, bias added
    int m, n;          // coordinates of the first (L) accumulator
  };

  // One step: 4 outputs (forward) or 4 (dL, dR) pairs (backward). Chunk c of the step is 8
  // columns right of chunk 0, in the same rows.
  // Backward: adds each (dL, dR) it computes to sum[2 c], sum[2 c + 1] (c: the chunk).
  template <GluKind K, bool Backward, bool Vector>
  CUTLASS_DEVICE void step(Step const& s, int m_total, int n2_total, float (&sum)[8]) {
    constexpr bool k16 = sizeof(Element) == 2;
    const int n_total = n2_total / 2;
    Element* out = params_.out;
    const Element* dy = params_.dy;
    const int m = s.m, n = s.n, q = (n >> 1) & 3;
    const bool row_ok = m < m_total;
    if constexpr (!Vector) {  // one element (forward) or pair (backward) at a time
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 4; ++c) {
        const int nc = n + 8 * c;
        if (!row_ok || nc >= n2_total) continue;
        const int64_t j = static_cast<int64_t>(m) * n_total + nc / 2;
        if constexpr (!Backward) {
          out[j] = Element(fk::device::glu<K, true>(s.l[c], s.r[c]));
          if constexpr (kSavePreact) {
            Pair pc;
            pc[0] = Element(s.l[c]);
            pc[1] = Element(s.r[c]);
            *reinterpret_cast<Pair*>(params_.preact + static_cast<int64_t>(m) * n2_total + nc) = pc;
          }
        } else {
          float dl, dr;
          fk::device::glu_grad<K, true>(s.l[c], s.r[c], static_cast<float>(dy[j]), dl, dr);
          sum[2 * c] += dl;
          sum[2 * c + 1] += dr;
          Pair pr;
          pr[0] = Element(dl);
          pr[1] = Element(dr);
          *reinterpret_cast<Pair*>(out + static_cast<int64_t>(m) * n2_total + nc) = pr;
        }
      }
      return;
    }
    // After a transpose this lane owns output columns col .. col + 3 (prepared columns
    // 2 col .. 2 col + 7); rows of 4k outputs keep them in bounds together.
    const int col = (n >> 1) + 3 * q;
    const bool store = row_ok && col < n_total;
    if constexpr (!Backward) {
      if constexpr (k16) {
        uint32_t w[2] = {pack2(fk::device::glu<K, true>(s.l[0], s.r[0]), fk::device::glu<K, true>(s.l[1], s.r[1])),
                         pack2(fk::device::glu<K, true>(s.l[2], s.r[2]), fk::device::glu<K, true>(s.l[3], s.r[3]))};
        quad_transpose_u16(w);
        if (store) *reinterpret_cast<uint2*>(out + static_cast<int64_t>(m) * n_total + col) = make_uint2(w[0], w[1]);
      } else {
        uint32_t w[4];
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 4; ++c) w[c] = __float_as_uint(fk::device::glu<K, true>(s.l[c], s.r[c]));
        quad_transpose_u32(w);
        if (store)
          *reinterpret_cast<uint4*>(out + static_cast<int64_t>(m) * n_total + col) = make_uint4(w[0], w[1], w[2], w[3]);
      }
      if constexpr (kSavePreact) store_pairs(s.l, s.r, params_.preact + static_cast<int64_t>(m) * n2_total + 2 * col, store);
    } else {
      // dy for the four outputs this lane owns after a transpose, transposed back to the lanes
      // that hold their accumulators.
      float gv[4];
      const Element* dyp = dy + static_cast<int64_t>(m) * n_total + col;
      if constexpr (k16) {
        const uint2 v = store ? *reinterpret_cast<const uint2*>(dyp) : make_uint2(0u, 0u);
        uint32_t w[2] = {v.x, v.y};
        quad_transpose_u16(w);
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 4; ++c) gv[c] = half_of(w[c / 2], c % 2);
      } else {
        const uint4 v = store ? *reinterpret_cast<const uint4*>(dyp) : make_uint4(0u, 0u, 0u, 0u);
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
        quad_transpose_u32(w);
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 4; ++c) gv[c] = __uint_as_float(w[c]);
      }
      float dl[4], dr[4];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 4; ++c) {
        // Outputs out of bounds have dy = 0 here (not loaded), so they add nothing.
        fk::device::glu_grad<K, true>(s.l[c], s.r[c], gv[c], dl[c], dr[c]);
        sum[2 * c] += dl[c];
        sum[2 * c + 1] += dr[c];
      }
      // Lane q then owns the pairs of chunk q of the step: prepared columns 2 col .. 2 col + 7.
      store_pairs(dl, dr, out + static_cast<int64_t>(m) * n2_total + 2 * col, store);
    }
  }

  template <GluKind K, bool Backward, class Acc, class Coords>
  CUTLASS_DEVICE void apply(Acc const& acc, Coords const& t_coords, int m_total, int n2_total) {
    static_assert(decltype(cute::size(acc))::value == kVals, "glu epilogue: unexpected accumulator fragment");
    // The chunks' bias pairs, shared by both rows: one 2-element load each, all issued up front.
    Pair bias[kChunks];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      const int n = cute::get<1>(t_coords(4 * c));
      if (kBiasHere && params_.bias != nullptr && n < n2_total) {
        bias[c] = *reinterpret_cast<const Pair*>(params_.bias + n);
      } else {
        bias[c][0] = Element(0);
        bias[c][1] = Element(0);
      }
    }
    // The accumulators are registers, so every index must be a constant: the code is unrolled
    // over them. (A loop picking each step's registers through a jump table pushed the
    // accumulators out of registers.) Straight-line code runs once per tile, from a cold
    // instruction cache when another kernel ran before, and instruction fetch is then what the
    // epilogue waits on. So:
    // - each path is one contiguous run of code: the vector / scalar branch is taken once here,
    //   not in every step;
    // - in the cooperative configuration (one or two waves of tiles, the code always cold) the
    //   groups run as a rolled loop of kItersFwd / kItersBwd iterations (see steps), the counts
    //   measured fastest.
    // The ping-pong configuration (many tiles a CTA, the code stays in the instruction cache) keeps
    // the unrolled code and the branch in every step in the backward: hoisted, its recompute GEMM
    // measured slower. (Measurements: docs/notes/glu.md.)
    if constexpr (Backward) {
      if constexpr (kBwdBranchPerStep) {
        steps<K, true, false, true>(acc, t_coords, bias, m_total, n2_total);
      } else {
        if (params_.vector_ok) steps<K, true, true, false, kItersBwd>(acc, t_coords, bias, m_total, n2_total);
        else steps<K, true, false, false, kItersBwd>(acc, t_coords, bias, m_total, n2_total);
      }
    } else {
      constexpr int kIt = kBwdBranchPerStep ? 1 : kItersFwd;
      if (params_.vector_ok) steps<K, false, true, false, kIt>(acc, t_coords, bias, m_total, n2_total);
      else steps<K, false, false, false, kIt>(acc, t_coords, bias, m_total, n2_total);
    }
  }

  // The slab sums of one group of 4 chunks: sum holds this thread's two rows (r, r + 8); the 8
  // lanes with the same lane % 4 hold the 16 rows of the warp's slab, whose first row is m (the
  // row of lanes 0..3). Lanes 0..3 write the slab's sums of their columns n + 8 c, n + 8 c + 1.
  CUTLASS_DEVICE void store_partial(float (&sum)[8], int m, int n, int m_total, int n2_total) {
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 8; ++v) {
      sum[v] += __shfl_xor_sync(0xffffffffu, sum[v], 4);
      sum[v] += __shfl_xor_sync(0xffffffffu, sum[v], 8);
      sum[v] += __shfl_xor_sync(0xffffffffu, sum[v], 16);
    }
    if ((threadIdx.x & 31) >= 4 || m >= m_total) return;
    float* row = params_.db_partial + static_cast<int64_t>(m >> 4) * n2_total;
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < 4; ++c)
      if (n + 8 * c < n2_total) *reinterpret_cast<float2*>(row + n + 8 * c) = make_float2(sum[2 * c], sum[2 * c + 1]);
  }

  // PerStep: choose the vector or scalar path in every step (at run time) instead of once.
  // kIters > 1: the 8 groups run as a rolled loop of kIters iterations of 8 / kIters groups each,
  // the accumulators (and bias pairs) shifted down by one iteration's worth at its end, so the code
  // is 1 / kIters as long (fetched cold once, then run warm) for 16 (8 / kIters) (kIters - 1)
  // register moves a thread.
  template <GluKind K, bool Backward, bool Vector, bool PerStep = false, int kIters = 1, class Acc, class Coords>
  CUTLASS_DEVICE void steps(Acc const& acc, Coords const& t_coords, Pair const (&bias_in)[kChunks], int m_total,
                            int n2_total) {
    constexpr int kGroups = kChunks / 4, kPer = kGroups / kIters;
    static_assert(kGroups % kIters == 0, "glu epilogue: iterations must divide the groups");
    float a[kVals];
    Pair bias[kChunks];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVals; ++i) a[i] = acc(i);
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kChunks; ++c) bias[c] = bias_in[c];
    // Iteration it sees group gg + it kPer at accumulators 16 gg ..: 32 kPer it columns right of
    // where group gg sits. That holds for one 64-row block a warpgroup (the cooperative 128 x 256
    // tile, the only one that iterates); the ping-pong tile's second 64-row block does not.
    static_assert(kIters == 1 || !kBwdBranchPerStep, "glu epilogue: iterations need the cooperative tile");
#pragma unroll 1
    for (int it = 0; it < kIters; ++it) {
      CUTLASS_PRAGMA_UNROLL
      for (int gg = 0; gg < kPer; ++gg) {
        const int n = cute::get<1>(t_coords(16 * gg)) + 32 * kPer * it;
        float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // backward: this group's (dL, dR) sums
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int i0 = 16 * gg + 2 * h;  // chunk 4 gg, row half h
          Step s;
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 4; ++c) {
            s.l[c] = a[i0 + 4 * c];
            s.r[c] = a[i0 + 4 * c + 1];
            if constexpr (kBiasHere) {
              s.l[c] += static_cast<float>(bias[4 * gg + c][0]);
              s.r[c] += static_cast<float>(bias[4 * gg + c][1]);
            }
          }
          s.m = cute::get<0>(t_coords(i0));
          s.n = n;
          if constexpr (PerStep) {
            if (params_.vector_ok) step<K, Backward, true>(s, m_total, n2_total, sum);
            else step<K, Backward, false>(s, m_total, n2_total, sum);
          } else {
            step<K, Backward, Vector>(s, m_total, n2_total, sum);
          }
        }
        if constexpr (Backward) {
          if (params_.db_partial != nullptr) store_partial(sum, cute::get<0>(t_coords(16 * gg)), n, m_total, n2_total);
        }
      }
      if constexpr (kIters > 1) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i + 16 * kPer < kVals; ++i) a[i] = a[i + 16 * kPer];
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c + 4 * kPer < kChunks; ++c) bias[c] = bias[c + 4 * kPer];
      }
    }
  }

  Params params_;
};

// The cooperative configuration's mainloop: CUTLASS's collective (Base, the builder's choice),
// except that a tile's accumulators start at the bias rather than at zero, so the epilogue, the
// tail of every CTA when the tiles are one wave, has no bias to load, convert and add (per thread
// 128 additions and 64 conversions, a fifth of the forward epilogue's instructions). The consumer
// loads its 64 bias values when its tile begins, before waiting for the tile's first stage, and
// writes them into the accumulators while the first stage is in flight; every wgmma then
// accumulates (scale-d 1), the first included.
//
// The consumer needs the tile's N coordinate before the first stage lands, and CUTLASS's kernel
// passes mma() no coordinates. So it asks the kernel's own tile scheduler (the static persistent
// one, built from the same problem shape, tile, cluster and hardware info as the kernel's), for
// the k-th tile of this CTA at its k-th mma() call: the kernel's consumer loop takes tiles in
// exactly that order, one mma() each.
template <class Base, class Element>
struct GluBiasMainloop : Base {
  using typename Base::TiledMma;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using TileShape = typename Base::TileShape;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using Scheduler = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using Pair = cutlass::Array<Element, 2>;

  struct Arguments : Base::Arguments {
    const Element* bias = nullptr;  // [2N] in the prepared layout, or null
    cutlass::KernelHardwareInfo hw{};  // the kernel's: the scheduler's grid depends on it
  };
  struct Params : Base::Params {
    const Element* bias;
    int n2;
    typename Scheduler::Params scheduler;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.bias = args.bias;
    p.n2 = static_cast<int>(cute::get<1>(problem_shape));
    // As the kernel computes its own (GemmUniversal::to_underlying_arguments, default scheduler
    // arguments).
    p.scheduler = Scheduler::to_underlying_arguments(cute::append<4>(problem_shape, 1), TileShape{}, ClusterShape{},
                                                     args.hw, typename Scheduler::Arguments{});
    return p;
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    using namespace cute;
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(thread_idx);
    cute::Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    cute::Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    cute::Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    cute::Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)

    // Accumulator i sits at column cols(i) of the tile, (i, i + 1) for even i two adjacent ones
    // of the same row (the wgmma fragment; the epilogue pairs them the same way).
    Scheduler scheduler(params.scheduler);
    scheduler.advance_to_next_work(static_cast<uint32_t>(tiles_++));
    const int n0 = scheduler.get_current_work().N_idx * static_cast<int>(size<1>(TileShape{}));
    cute::Tensor cols = thread_mma.partition_C(make_identity_tensor(take<0, 2>(TileShape{})));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
      const int n = n0 + get<1>(cols(i));
      Pair b;
      if (params.bias != nullptr && n < params.n2) {
        b = *reinterpret_cast<const Pair*>(params.bias + n);
      } else {
        b[0] = Element(0);
        b[1] = Element(0);
      }
      accum(i) = static_cast<float>(b[0]);
      accum(i + 1) = static_cast<float>(b[1]);
    }

    // CUTLASS's pipelined loop (one wgmma batch in flight: after issuing k-tile kt, wait for
    // kt - 1's and release its stage; mma_tail releases the last), every wgmma accumulating.
    // (Zeroing by the first wgmma when there is no bias, the accumulators then left undefined
    // before it, made ptxas serialize the wgmmas of the f16 and TF32 kernels: C7515.)
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    PipelineState smem_pipe_release = smem_pipe_read;
    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int kt = 0; kt < k_tile_count; ++kt) {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
      const int stage = smem_pipe_read.index();
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb)
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
      warpgroup_commit_batch();
      ++smem_pipe_read;
      if (kt > 0) {
        warpgroup_wait<1>();
        warpgroup_fence_operand(accum);
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
    }
    warpgroup_fence_operand(accum);
  }

 private:
  int tiles_ = 0;  // mma() calls so far: this CTA's tiles
};

// Mainloop configurations: (tile M, tile N, cluster M, cluster N, ping-pong schedule).
template <int TM, int TN, int CM, int CN, bool PP>
struct Cfg {};
// Up to two waves of 128 x 256 tiles (and TF32): both consumer warpgroups on one tile
// (cooperative), no clusters: each CTA loads its own w tile. With the bias in the accumulators,
// clusters of 2 along M sharing w by multicast made the small forwards slower (no CTA now waits
// for a cluster peer's stage releases).
using Cooperative = Cfg<128, 256, 1, 1, false>;
// Many tiles: 128 x 128 tiles, the two consumer warpgroups on alternate tiles so that one's
// epilogue runs under the other's mainloop (ping-pong), x multicast along N: at large shapes it
// measured faster than the cooperative configuration and at or under the cuBLAS GEMM alone.
using PingPong = Cfg<128, 128, 1, 2, true>;

template <class Element, class C, GluKind K, bool kBackward, bool kSavePreact>
struct GluGemmConfig;
template <class Element, int TM, int TN, int CM, int CN, bool PP, GluKind K, bool kBackward, bool kSavePreact>
struct GluGemmConfig<Element, Cfg<TM, TN, CM, CN, PP>, K, kBackward, kSavePreact> {
  // 64-deep k-blocks of 16-bit operands, 32-deep of TF32: 128-byte rows either way.
  static constexpr int kBlockK = sizeof(Element) == 2 ? 64 : 32;
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<kBlockK>>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using Epilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
          GluEpilogue<Element, PP, K, kBackward, PP, kSavePreact>>;
  static constexpr int kAlignment = 16 / sizeof(Element);
  using KernelSchedule = cute::conditional_t<!PP, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                             cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignment, Element,
      cutlass::layout::ColumnMajor, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  // Cooperative: the bias goes into the accumulators (GluBiasMainloop); ping-pong: into the
  // epilogue, which runs under the other warpgroup's mainloop there.
  using Mainloop = cute::conditional_t<PP, BuiltMainloop, GluBiasMainloop<BuiltMainloop, Element>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(PP || cute::is_same_v<typename Kernel::TileScheduler,
                                      typename GluBiasMainloop<BuiltMainloop, Element>::Scheduler>,
                "glu: GluBiasMainloop follows the static persistent tile scheduler");
};


template <class Element, class Schedule, GluKind K, bool kBackward, bool kSavePreact>
void run_fused(const TensorView& x, const TensorView& w, const TensorView* bias, const TensorView* dy,
               const TensorView& out, const TensorView* db_partial, const TensorView* preact, const Stream* stream) {
  using Config = GluGemmConfig<Element, Schedule, K, kBackward, kSavePreact>;
  using Gemm = typename Config::Gemm;
  const int m = static_cast<int>(x.size(0)), k = static_cast<int>(x.size(1)), n2 = static_cast<int>(w.size(0));
  // Both operands K-major: (row stride, 1, batch stride).
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  static_assert(cute::is_same_v<StrideA, cute::Stride<int64_t, cute::Int<1>, int64_t>> &&
                cute::is_same_v<StrideB, StrideA>, "glu: the fused GEMM expects K-major x and w");
  const StrideA stride_a = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{m} * k);
  const StrideB stride_b = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{n2} * k);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = x.device().index;
  hw.sm_count = multiprocessor_count();
  typename Config::Mainloop::Arguments mainloop{};
  static_cast<typename Config::BuiltMainloop::Arguments&>(mainloop) = {
      static_cast<const Element*>(x.data()), stride_a, static_cast<const Element*>(w.data()), stride_b};
  if constexpr (requires { mainloop.bias; }) {
    mainloop.bias = bias ? static_cast<const Element*>(bias->data()) : nullptr;
    mainloop.hw = hw;
  }
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n2, k, 1},
      mainloop,
      {bias ? static_cast<const Element*>(bias->data()) : nullptr, static_cast<Element*>(out.data()),
       dy ? static_cast<const Element*>(dy->data()) : nullptr,
       n2 % 8 == 0 && aligned16(out.data()) && (dy == nullptr || aligned16(dy->data())) &&
           (preact == nullptr || aligned16(preact->data())),
       db_partial ? static_cast<float*>(db_partial->data()) : nullptr, n2,
       preact ? static_cast<Element*>(preact->data()) : nullptr},
      hw};
  sm90::run_gemm<Gemm>(args, x.device(), stream, "glu_forward (fused GEMM)");
}

template <class Element, class Schedule, GluKind K>
void run_direction(const TensorView& x, const TensorView& w, const TensorView* bias, const TensorView* dy,
                   const TensorView& out, const TensorView* db_partial, const TensorView* preact,
                   const Stream* stream) {
  if (dy != nullptr) run_fused<Element, Schedule, K, true, false>(x, w, bias, dy, out, db_partial, nullptr, stream);
  else if (preact != nullptr) run_fused<Element, Schedule, K, false, true>(x, w, bias, dy, out, nullptr, preact, stream);
  else run_fused<Element, Schedule, K, false, false>(x, w, bias, dy, out, nullptr, nullptr, stream);
}

}  // namespace fk::cuda::glu_detail

namespace fk::cuda {

template <GluKind K>
void glu_gemm_run(const TensorView& x, const TensorView& w, const TensorView* bias, const TensorView* dy,
                  const TensorView& out, const TensorView* db_partial, const TensorView* preact, bool many_tiles,
                  const Stream* stream) {
  using namespace glu_detail;
  switch (x.dtype()) {
    case DType::bf16:
      many_tiles ? run_direction<cutlass::bfloat16_t, PingPong, K>(x, w, bias, dy, out, db_partial, preact, stream)
                 : run_direction<cutlass::bfloat16_t, Cooperative, K>(x, w, bias, dy, out, db_partial, preact, stream);
      return;
    case DType::f16:
      many_tiles ? run_direction<cutlass::half_t, PingPong, K>(x, w, bias, dy, out, db_partial, preact, stream)
                 : run_direction<cutlass::half_t, Cooperative, K>(x, w, bias, dy, out, db_partial, preact, stream);
      return;
    case DType::f32:
      run_direction<float, Cooperative, K>(x, w, bias, dy, out, db_partial, preact, stream);
      return;
    default:
      throw Error("glu_forward (fused GEMM)", "no kernel for this dtype");  // glu_gemm_fused checked it
  }
}

}  // namespace fk::cuda
