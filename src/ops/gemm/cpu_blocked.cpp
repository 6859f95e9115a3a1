// The CPU backend of `gemm` for f32 without an epilogue (the CPU trainer's GEMMs). The spec
// (reference.cpp) reads every element through a dtype switch and accumulates in double: right for
// checking kernels, but ~50x too slow to train a DLRM on. This runs row-panel axpy loops that the
// compiler vectorises (an AVX2/FMA build of them is chosen at run time where the CPU has it) and
// blocks K so that the B panel stays in L2. Float accumulation.
#include "ops/gemm/gemm_impl.hpp"

#include <algorithm>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define FK_CPU_DISPATCH 1
#include <immintrin.h>
#else
#define FK_CPU_DISPATCH 0
#endif

namespace fk::gemm_detail {

namespace {

constexpr std::int64_t kBlockK = 256;

// C rows [i0, i0 + 4) += A(i, p) * B row p over p in [p0, p1) (= when `overwrite`): four C rows
// share each B load.
inline void panel4_body(bool overwrite, std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha,
                        const float* a_row[4], std::int64_t a_step, const float* __restrict b, std::int64_t ldb,
                        float* __restrict c0, float* __restrict c1, float* __restrict c2, float* __restrict c3) {
  if (overwrite)
    for (float* c : {c0, c1, c2, c3}) std::fill(c, c + n, 0.0f);
  for (std::int64_t p = p0; p < p1; ++p) {
    const float x0 = alpha * a_row[0][p * a_step], x1 = alpha * a_row[1][p * a_step],
                x2 = alpha * a_row[2][p * a_step], x3 = alpha * a_row[3][p * a_step];
    const float* __restrict bp = b + p * ldb;
    for (std::int64_t j = 0; j < n; ++j) {
      const float v = bp[j];
      c0[j] += x0 * v;
      c1[j] += x1 * v;
      c2[j] += x2 * v;
      c3[j] += x3 * v;
    }
  }
}

inline void panel1_body(bool overwrite, std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha,
                        const float* a_row, std::int64_t a_step, const float* __restrict b, std::int64_t ldb,
                        float* __restrict c) {
  if (overwrite) std::fill(c, c + n, 0.0f);
  for (std::int64_t p = p0; p < p1; ++p) {
    const float x = alpha * a_row[p * a_step];
    if (x == 0.0f) continue;  // ReLU outputs and one-hot rows are often zero
    const float* __restrict bp = b + p * ldb;
    for (std::int64_t j = 0; j < n; ++j) c[j] += x * bp[j];
  }
}

// The kernels compiled twice: for the baseline x86-64 (SSE2) and for AVX2 + FMA, picked once at
// run time from the CPU's features. (GCC's target_clones dispatcher chose the baseline clone on
// AVX-512 machines here, so the choice is made by hand.)
using Panel4 = void (*)(bool, std::int64_t, std::int64_t, std::int64_t, float, const float**, std::int64_t,
                        const float*, std::int64_t, float*, float*, float*, float*);
using Panel1 = void (*)(bool, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t,
                        const float*, std::int64_t, float*);

void panel4_base(bool overwrite, std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha, const float** a,
                 std::int64_t s, const float* b, std::int64_t ldb, float* c0, float* c1, float* c2, float* c3) {
  panel4_body(overwrite, n, p0, p1, alpha, a, s, b, ldb, c0, c1, c2, c3);
}
void panel1_base(bool overwrite, std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha, const float* a,
                 std::int64_t s, const float* b, std::int64_t ldb, float* c) {
  panel1_body(overwrite, n, p0, p1, alpha, a, s, b, ldb, c);
}

#if FK_CPU_DISPATCH
// A 4 x 16 tile of C in eight AVX registers for the whole K block (the generic body keeps C in
// memory and is bound by its loads and stores); the columns past the last full tile go through
// the generic body.
__attribute__((target("avx2,fma"))) void panel4_avx2(bool overwrite, std::int64_t n, std::int64_t p0, std::int64_t p1,
                                                     float alpha, const float** a, std::int64_t s, const float* b,
                                                     std::int64_t ldb, float* c0, float* c1, float* c2, float* c3) {
  float* const c[4] = {c0, c1, c2, c3};
  const __m256 scale = _mm256_set1_ps(alpha);
  std::int64_t j0 = 0;
  for (; j0 + 16 <= n; j0 += 16) {
    __m256 acc[4][2];
    for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
    for (std::int64_t p = p0; p < p1; ++p) {
      const float* bp = b + p * ldb + j0;
      const __m256 lo = _mm256_loadu_ps(bp), hi = _mm256_loadu_ps(bp + 8);
      for (int r = 0; r < 4; ++r) {
        const __m256 x = _mm256_broadcast_ss(a[r] + p * s);
        acc[r][0] = _mm256_fmadd_ps(x, lo, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x, hi, acc[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      float* cr = c[r] + j0;
      if (overwrite) {
        _mm256_storeu_ps(cr, _mm256_mul_ps(scale, acc[r][0]));
        _mm256_storeu_ps(cr + 8, _mm256_mul_ps(scale, acc[r][1]));
      } else {
        _mm256_storeu_ps(cr, _mm256_fmadd_ps(scale, acc[r][0], _mm256_loadu_ps(cr)));
        _mm256_storeu_ps(cr + 8, _mm256_fmadd_ps(scale, acc[r][1], _mm256_loadu_ps(cr + 8)));
      }
    }
  }
  if (j0 < n) panel4_body(overwrite, n - j0, p0, p1, alpha, a, s, b + j0, ldb, c0 + j0, c1 + j0, c2 + j0, c3 + j0);
}
__attribute__((target("avx2,fma"))) void panel1_avx2(bool overwrite, std::int64_t n, std::int64_t p0, std::int64_t p1,
                                                     float alpha, const float* a, std::int64_t s, const float* b,
                                                     std::int64_t ldb, float* c) {
  panel1_body(overwrite, n, p0, p1, alpha, a, s, b, ldb, c);
}
bool has_avx2_fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
const Panel4 panel4 = has_avx2_fma() ? panel4_avx2 : panel4_base;
const Panel1 panel1 = has_avx2_fma() ? panel1_avx2 : panel1_base;
#else
const Panel4 panel4 = panel4_base;
const Panel1 panel1 = panel1_base;
#endif

}  // namespace

void sgemm_blocked(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  // B as [K, N] row-major: transpose it once when given as [N, K].
  std::vector<float> bt;
  if (trans_b) {
    bt.resize(static_cast<std::size_t>(k * n));
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t p = 0; p < k; ++p) bt[static_cast<std::size_t>(p * n + j)] = b[j * ldb + p];
    b = bt.data();
    ldb = n;
  }
  // beta == 0: the first K block overwrites C (no zero-fill pass over C); otherwise C is scaled
  // first and every block accumulates.
  const bool fresh = beta == 0.0f;
  if (!fresh || k == 0 || alpha == 0.0f)
    for (std::int64_t i = 0; i < m; ++i) {
      float* crow = c + i * ldc;
      if (fresh) {
        std::fill(crow, crow + n, 0.0f);
      } else if (beta != 1.0f) {
        for (std::int64_t j = 0; j < n; ++j) crow[j] *= beta;
      }
    }
  if (k == 0 || alpha == 0.0f) return;
  // Element (i, p) of op(A) is a[i * row_step + p * a_step].
  const std::int64_t row_step = trans_a ? 1 : lda, a_step = trans_a ? lda : 1;
  // K blocks outermost: one B panel [kBlockK, N] serves every row of C while it is in cache.
  for (std::int64_t p0 = 0; p0 < k; p0 += kBlockK) {
    const std::int64_t p1 = std::min(k, p0 + kBlockK);
    const bool overwrite = fresh && p0 == 0;
    std::int64_t i0 = 0;
    for (; i0 + 4 <= m; i0 += 4) {
      const float* ar[4] = {a + i0 * row_step, a + (i0 + 1) * row_step, a + (i0 + 2) * row_step,
                            a + (i0 + 3) * row_step};
      panel4(overwrite, n, p0, p1, alpha, ar, a_step, b, ldb, c + i0 * ldc, c + (i0 + 1) * ldc, c + (i0 + 2) * ldc,
             c + (i0 + 3) * ldc);
    }
    for (; i0 < m; ++i0) panel1(overwrite, n, p0, p1, alpha, a + i0 * row_step, a_step, b, ldb, c + i0 * ldc);
  }
}

}  // namespace fk::gemm_detail
