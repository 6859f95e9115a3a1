#include "models/cpu_gemm.hpp"

#include <algorithm>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define FK_CPU_DISPATCH 1
#else
#define FK_CPU_DISPATCH 0
#endif

namespace fk::models::cpu {

namespace {

constexpr std::int64_t kBlockK = 256;

// C rows [i0, i0 + 4) += A(i, p) * B row p over p in [p0, p1): four C rows share each B load.
inline void panel4_body(std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha, const float* a_row[4],
                          std::int64_t a_step, const float* __restrict b, std::int64_t ldb, float* __restrict c0,
                          float* __restrict c1, float* __restrict c2, float* __restrict c3) {
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

inline void panel1_body(std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha, const float* a_row, std::int64_t a_step,
                          const float* __restrict b, std::int64_t ldb, float* __restrict c) {
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
using Panel4 = void (*)(std::int64_t, std::int64_t, std::int64_t, float, const float**, std::int64_t, const float*,
                        std::int64_t, float*, float*, float*, float*);
using Panel1 = void (*)(std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t, const float*,
                        std::int64_t, float*);

void panel4_base(std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha, const float** a, std::int64_t s,
                 const float* b, std::int64_t ldb, float* c0, float* c1, float* c2, float* c3) {
  panel4_body(n, p0, p1, alpha, a, s, b, ldb, c0, c1, c2, c3);
}
void panel1_base(std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha, const float* a, std::int64_t s,
                 const float* b, std::int64_t ldb, float* c) {
  panel1_body(n, p0, p1, alpha, a, s, b, ldb, c);
}

#if FK_CPU_DISPATCH
__attribute__((target("avx2,fma"))) void panel4_avx2(std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha,
                                                     const float** a, std::int64_t s, const float* b, std::int64_t ldb,
                                                     float* c0, float* c1, float* c2, float* c3) {
  panel4_body(n, p0, p1, alpha, a, s, b, ldb, c0, c1, c2, c3);
}
__attribute__((target("avx2,fma"))) void panel1_avx2(std::int64_t n, std::int64_t p0, std::int64_t p1, float alpha,
                                                     const float* a, std::int64_t s, const float* b, std::int64_t ldb,
                                                     float* c) {
  panel1_body(n, p0, p1, alpha, a, s, b, ldb, c);
}
bool has_avx2_fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
const Panel4 panel4 = has_avx2_fma() ? panel4_avx2 : panel4_base;
const Panel1 panel1 = has_avx2_fma() ? panel1_avx2 : panel1_base;
#else
const Panel4 panel4 = panel4_base;
const Panel1 panel1 = panel1_base;
#endif

}  // namespace

void sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
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
  for (std::int64_t i = 0; i < m; ++i) {
    float* crow = c + i * ldc;
    if (beta == 0.0f) {
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
    std::int64_t i0 = 0;
    for (; i0 + 4 <= m; i0 += 4) {
      const float* ar[4] = {a + i0 * row_step, a + (i0 + 1) * row_step, a + (i0 + 2) * row_step,
                            a + (i0 + 3) * row_step};
      panel4(n, p0, p1, alpha, ar, a_step, b, ldb, c + i0 * ldc, c + (i0 + 1) * ldc, c + (i0 + 2) * ldc,
             c + (i0 + 3) * ldc);
    }
    for (; i0 < m; ++i0) panel1(n, p0, p1, alpha, a + i0 * row_step, a_step, b, ldb, c + i0 * ldc);
  }
}

}  // namespace fk::models::cpu
