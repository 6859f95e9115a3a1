// Device-side activations and their derivatives, fp32, matching reference::activation and
// reference::activation_grad (pointwise/reference.cpp). Shared by every family that fuses an
// activation into its epilogue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "fusekit/ops/pointwise.hpp"

namespace fk::device {

inline constexpr float kSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluC = 0.044715f;
inline constexpr float kInvSqrt2 = 0.7071067811865476f;
inline constexpr float kInvSqrt2Pi = 0.3989422804014327f;

__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

template <Activation A>
__device__ __forceinline__ float activation(float z) {
  if constexpr (A == Activation::identity) return z;
  if constexpr (A == Activation::relu) return (z > 0.0f || z != z) ? z : 0.0f;  // NaN propagates
  if constexpr (A == Activation::sigmoid) return sigmoid(z);
  if constexpr (A == Activation::tanh) return tanhf(z);
  if constexpr (A == Activation::gelu_tanh) return 0.5f * z * (1.0f + tanhf(kSqrt2OverPi * (z + kGeluC * z * z * z)));
  if constexpr (A == Activation::gelu_erf) return 0.5f * z * (1.0f + erff(z * kInvSqrt2));
  if constexpr (A == Activation::silu) return z * sigmoid(z);
}

// act'(z) from the pre-activation z.
template <Activation A>
__device__ __forceinline__ float activation_grad(float z) {
  if constexpr (A == Activation::identity) return 1.0f;
  if constexpr (A == Activation::relu) return z > 0.0f ? 1.0f : 0.0f;
  if constexpr (A == Activation::sigmoid) { const float s = sigmoid(z); return s * (1.0f - s); }
  if constexpr (A == Activation::tanh) { const float t = tanhf(z); return 1.0f - t * t; }
  if constexpr (A == Activation::gelu_tanh) {
    const float t = tanhf(kSqrt2OverPi * (z + kGeluC * z * z * z));
    return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluC * z * z);
  }
  if constexpr (A == Activation::gelu_erf) return 0.5f * (1.0f + erff(z * kInvSqrt2)) + z * kInvSqrt2Pi * expf(-0.5f * z * z);
  if constexpr (A == Activation::silu) { const float s = sigmoid(z); return s * (1.0f + z * (1.0f - s)); }
}

// act'(z) from the output y = act(z); only for the activations where derivative_from_output holds.
template <Activation A>
__device__ __forceinline__ float activation_grad_from_output(float y) {
  if constexpr (A == Activation::identity) return 1.0f;
  if constexpr (A == Activation::relu) return y > 0.0f ? 1.0f : 0.0f;
  if constexpr (A == Activation::sigmoid) return y * (1.0f - y);
  if constexpr (A == Activation::tanh) return 1.0f - y * y;
  return 0.0f;  // not reachable: dispatch rejects the others
}

// Conversions between storage types and fp32.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// N elements of T moved as one access (16 bytes when N * sizeof(T) == 16). The 16-bit types are
// held as raw bits: arrays of __nv_bfloat16 / __half objects (classes with constructors) end up
// in local memory when indexed in unrolled loops, while plain integers stay in registers.
template <class T> struct Bits { using type = T; };
template <> struct Bits<__nv_bfloat16> { using type = unsigned short; };
template <> struct Bits<__half> { using type = unsigned short; };

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  typename Bits<T>::type v[N];
  __device__ __forceinline__ float get(int j) const {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(static_cast<unsigned>(v[j]) << 16);
    else if constexpr (std::is_same_v<T, __half>) return __half2float(__ushort_as_half(v[j]));
    else return v[j];
  }
  __device__ __forceinline__ void set(int j, float f) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) v[j] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    else if constexpr (std::is_same_v<T, __half>) v[j] = __half_as_ushort(__float2half_rn(f));
    else v[j] = f;
  }
};

// The integer word of a Vec's access: 16-byte Vecs (and wider, in 16-byte words) move as uint4,
// one 128-bit instruction each. 16- and 8-byte stores are written in PTX: left to copy the struct
// (or a uint4 built from it), the compiler at times split the store of values converted one by
// one into 4-byte or 2-byte stores. Global memory only. kStream: the 16-byte accesses of data
// read or written once (a memory-bound pass's rows) marked evict-first (.cs), so that they do not
// displace what is reused (a norm's weights, rope's tables); figures in docs/notes/llm-training.md.
template <int Bytes> struct Word { using type = uint4; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<4> { using type = unsigned; };
template <> struct Word<2> { using type = unsigned short; };
template <class T, int N>
using VecWord = typename Word<(sizeof(Vec<T, N>) < 16 ? sizeof(Vec<T, N>) : 16)>::type;

template <class T, int N, bool kStream = false>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  using W = VecWord<T, N>;
  constexpr int kWords = sizeof(Vec<T, N>) / sizeof(W);
  W w[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    const W* q = reinterpret_cast<const W*>(p) + i;
    if constexpr (kStream && sizeof(W) == 16) w[i] = __ldcs(q);
    else w[i] = *q;
  }
  Vec<T, N> v;
  memcpy(&v, w, sizeof(v));
  return v;
}
template <class T, int N, bool kStream = false>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  using W = VecWord<T, N>;
  constexpr int kWords = sizeof(Vec<T, N>) / sizeof(W);
  W w[kWords];
  memcpy(w, &v, sizeof(v));
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    W* q = reinterpret_cast<W*>(p) + i;
    if constexpr (sizeof(W) == 16 && kStream)
      asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(q), "r"(w[i].x), "r"(w[i].y), "r"(w[i].z),
                   "r"(w[i].w)
                   : "memory");
    else if constexpr (sizeof(W) == 16)
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(q), "r"(w[i].x), "r"(w[i].y), "r"(w[i].z),
                   "r"(w[i].w)
                   : "memory");
    else if constexpr (sizeof(W) == 8)
      asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(q), "r"(w[i].x), "r"(w[i].y) : "memory");
    else
      *q = w[i];
  }
}

}  // namespace fk::device
