// The CUDA backend of `gemm`: cublasGemmEx / cublasGemmStridedBatchedEx without an epilogue,
// cublasLtMatmul with the epilogue fused otherwise.
//
// Row-major c = op(a) op(b) is column-major cᵀ = op(b)ᵀ op(a)ᵀ: cuBLAS gets b as its first
// operand and a as its second, with M and N swapped; every leading dimension is the row stride
// of the row-major matrix. A bias over c's columns is then a bias over the column-major rows,
// which is what cuBLASLt's epilogues broadcast, and its "B" operand is our a (bgrad_a = BGRADB).
//
// cuBLASLt is asked for an algorithm once per problem shape (sizes, strides, types, epilogue and
// the pointers' alignments, so that an algorithm never assumes more alignment than it gets), and
// the answer is cached for the process. Its workspace is one buffer per (device, stream), made
// on first use from fusekit's allocator and kept for the process, so two streams never share one.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <array>
#include <map>
#include <mutex>

#include "fusekit/core/allocator.hpp"
#include "fusekit/core/cuda_check.hpp"
#include "fusekit/core/error.hpp"
#include "ops/gemm/gemm_impl.hpp"

namespace fk::gemm_detail {

namespace {

constexpr std::size_t kLtWorkspaceBytes = std::size_t{32} << 20;

cublasOperation_t op(Trans t) { return t == Trans::t ? CUBLAS_OP_T : CUBLAS_OP_N; }

cublasComputeType_t compute_type(const Problem& q) {
  return q.p.allow_tf32 && q.in_type == DType::f32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

// The largest power of two (up to 256) that divides the address.
std::int64_t alignment(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  std::int64_t a = 256;
  while (a > 1 && v % static_cast<std::uintptr_t>(a) != 0) a /= 2;
  return a;
}

cublasLtEpilogue_t lt_epilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::relu: return CUBLASLT_EPILOGUE_RELU;
    case GemmEpilogue::relu_bias: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case GemmEpilogue::gelu: return CUBLASLT_EPILOGUE_GELU;
    case GemmEpilogue::gelu_bias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case GemmEpilogue::gelu_aux_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::dgelu: return CUBLASLT_EPILOGUE_DGELU;
    case GemmEpilogue::dgelu_bgrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case GemmEpilogue::bgrad_a: return CUBLASLT_EPILOGUE_BGRADB;
  }
  throw_internal("gemm: epilogue not mapped");
}

// Process-wide cuBLASLt state: one handle per device, cached algorithms, workspaces per stream.
// Never destroyed (as the cuBLAS handles of CublasLease): a static destructor could run after the
// CUDA runtime is gone.
struct LtState {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::array<std::int64_t, 20>, cublasLtMatmulAlgo_t> algos;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
};
LtState& lt_state() {
  static LtState* s = new LtState();
  return *s;
}

// RAII for the descriptors of one call.
struct LtCall {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtCall() = default;
  LtCall(const LtCall&) = delete;
  LtCall& operator=(const LtCall&) = delete;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

template <class T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  FK_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

void gemm_lt(const Problem& q, const Stream* owner, cudaStream_t stream) {
  const int device = q.device.index;
  LtState& st = lt_state();
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  {
    const std::lock_guard<std::mutex> lock(st.mutex);
    auto h = st.handles.find(device);
    if (h == st.handles.end()) {
      cublasLtHandle_t made = nullptr;
      FK_CUBLAS_CHECK(cublasLtCreate(&made));
      h = st.handles.emplace(device, made).first;
    }
    handle = h->second;
    auto w = st.workspaces.find({device, stream});
    if (w == st.workspaces.end())
      w = st.workspaces.emplace(std::pair{device, stream}, allocator::allocate(kLtWorkspaceBytes, q.device, owner)).first;
    workspace = w->second;
  }
  const cudaDataType_t tin = fk::detail::cuda_data_type(q.in_type), tout = fk::detail::cuda_data_type(q.out_type);
  const bool ta = q.p.trans_a == Trans::t, tb = q.p.trans_b == Trans::t;
  LtCall call;
  FK_CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.desc, compute_type(q), CUDA_R_32F));
  set_desc(call.desc, CUBLASLT_MATMUL_DESC_TRANSA, op(q.p.trans_b));
  set_desc(call.desc, CUBLASLT_MATMUL_DESC_TRANSB, op(q.p.trans_a));
  set_desc(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(q.p.epilogue));
  const void* bias = q.bias ? q.bias : q.bias_grad;
  if (bias) set_desc(call.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  if (q.aux.data) {
    set_desc(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(q.aux.data));
    set_desc(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, q.aux.ld);
  }
  // Column-major shapes as stored: b [K, N] row-major is (N x K), a [M, K] is (K x M), c is (N x M).
  FK_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, tin, tb ? q.k : q.n, tb ? q.n : q.k, q.b.ld));
  FK_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, tin, ta ? q.m : q.k, ta ? q.k : q.m, q.a.ld));
  FK_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, tout, q.n, q.m, q.c.ld));

  const std::int64_t align_a = alignment(q.b.data), align_b = alignment(q.a.data), align_c = alignment(q.c.data);
  const std::int64_t align_extra = std::min(bias ? alignment(bias) : 256, q.aux.data ? alignment(q.aux.data) : 256);
  const std::array<std::int64_t, 20> key = {device, static_cast<std::int64_t>(q.p.epilogue),
                                            static_cast<std::int64_t>(q.in_type), static_cast<std::int64_t>(q.out_type),
                                            ta, tb, q.m, q.n, q.k, q.a.ld, q.b.ld, q.c.ld, q.aux.ld,
                                            compute_type(q), align_a, align_b, align_c, align_extra, 0, 0};
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  {
    const std::lock_guard<std::mutex> lock(st.mutex);
    if (auto it = st.algos.find(key); it != st.algos.end()) {
      algo = it->second;
      found = true;
    }
  }
  if (!found) {
    FK_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&call.pref));
    const std::size_t ws = kLtWorkspaceBytes;
    FK_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                         sizeof(ws)));
    const std::uint32_t aa = static_cast<std::uint32_t>(align_a), ab = static_cast<std::uint32_t>(align_b),
                        ac = static_cast<std::uint32_t>(align_c);
    FK_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa,
                                                         sizeof(aa)));
    FK_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab,
                                                         sizeof(ab)));
    FK_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac,
                                                         sizeof(ac)));
    FK_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac,
                                                         sizeof(ac)));
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    const cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(handle, call.desc, call.a, call.b, call.c, call.c, call.pref, 1, &result, &count);
    FK_CHECK_ARG(s == CUBLAS_STATUS_SUCCESS && count > 0, "gemm", "epilogue",
                 fmt::format("a problem cuBLASLt can run with epilogue {} (row strides multiples of 16 bytes, "
                             "16-byte aligned pointers, an aux row stride that is a multiple of 8)",
                             gemm_epilogue_name(q.p.epilogue)),
                 fmt::format("M {} N {} K {}, row strides a {} b {} c {} aux {}, alignments a {} b {} c {} bias/aux {}",
                             q.m, q.n, q.k, q.a.ld, q.b.ld, q.c.ld, q.aux.ld, align_b, align_a, align_c, align_extra));
    algo = result.algo;
    const std::lock_guard<std::mutex> lock(st.mutex);
    st.algos.emplace(key, algo);
  }
  const float alpha = q.p.alpha, beta = q.p.beta;
  FK_CUBLAS_CHECK(cublasLtMatmul(handle, call.desc, &alpha, q.b.data, call.a, q.a.data, call.b, &beta, q.c.data, call.c,
                                 q.c.data, call.c, &algo, workspace, kLtWorkspaceBytes, stream));
}

}  // namespace

void gemm_cuda(const Problem& q, const Stream* stream) {
  const fk::detail::DeviceScope on_device(q.device.index);
  const cudaStream_t s = fk::detail::cuda_stream(stream);
  const std::size_t out_size = dtype_size(q.out_type);
  if (q.k == 0) {  // c = beta c with beta 0 or 1 (checked by the caller)
    if (q.p.beta == 0.0f)
      for (std::int64_t g = 0; g < q.batch; ++g)
        FK_CUDA_CHECK(cudaMemset2DAsync(static_cast<char*>(q.c.data) + g * q.c.batch_stride * out_size,
                                        static_cast<std::size_t>(q.c.ld) * out_size, 0,
                                        static_cast<std::size_t>(q.n) * out_size, static_cast<std::size_t>(q.m), s));
    return;
  }
  if (q.p.epilogue != GemmEpilogue::none) return gemm_lt(q, stream, s);
  const fk::detail::CublasLease cublas(q.device.index, s);
  const cudaDataType_t tin = fk::detail::cuda_data_type(q.in_type), tout = fk::detail::cuda_data_type(q.out_type);
  const float alpha = q.p.alpha, beta = q.p.beta;
  const int m = static_cast<int>(q.m), n = static_cast<int>(q.n), k = static_cast<int>(q.k);
  const int lda = static_cast<int>(q.a.ld), ldb = static_cast<int>(q.b.ld), ldc = static_cast<int>(q.c.ld);
  if (q.batch == 1) {
    FK_CUBLAS_CHECK(cublasGemmEx(cublas.get(), op(q.p.trans_b), op(q.p.trans_a), n, m, k, &alpha, q.b.data, tin, ldb,
                                 q.a.data, tin, lda, &beta, q.c.data, tout, ldc, compute_type(q), CUBLAS_GEMM_DEFAULT));
    return;
  }
  FK_CUBLAS_CHECK(cublasGemmStridedBatchedEx(cublas.get(), op(q.p.trans_b), op(q.p.trans_a), n, m, k, &alpha, q.b.data,
                                             tin, ldb, q.b.batch_stride, q.a.data, tin, lda, q.a.batch_stride, &beta,
                                             q.c.data, tout, ldc, q.c.batch_stride, static_cast<int>(q.batch),
                                             compute_type(q), CUBLAS_GEMM_DEFAULT));
}

}  // namespace fk::gemm_detail
