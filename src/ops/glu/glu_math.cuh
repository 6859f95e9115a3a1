// glu(l, r) = gate(l) * value(r) and its derivatives on the device, fp32, matching
// reference::glu / glu_dl / glu_dr (glu/reference.cpp).
//
// Two flavours. Accurate (Fast = false): the pointwise family's activations (libm expf, tanhf,
// erff), for the unfused pass that also serves full-fp32 callers. Fast (Fast = true), for the
// fused GEMM epilogue, where every instruction is paid once per output on the critical path of a
// tile and a fully unrolled epilogue must stay small enough for the instruction cache:
//   sigmoid(z) = 1 / (1 + 2^(-z log2 e))      ex2.approx + fast reciprocal: relative error ~1e-6
//                (silu and gelu_tanh, whose outputs scale with it)
//   the sigmoid gate of sigmoid_tanh: 0.5 + 0.5 tanh.approx(z / 2), one MUFU op instead of two:
//                absolute error <= 2^-12 (so a gate near 0 has a large relative error, and may be
//                up to 2^-12 below 0), under half a bf16 ulp of any product above 2^-3
//   tanh(z)    = tanh.approx.f32              one MUFU op, relative error <= 2^-10.99
//   gelu_tanh  = z sigmoid(2u), u = sqrt(2/pi)(z + 0.044715 z^3)   (= 0.5 z (1 + tanh u),
//                without the cancellation of 1 + tanh u for negative z)
//   gelu_erf   = erff as in the accurate flavour
// The outputs are bf16, f16 or TF32-fed fp32, whose rounding (2^-9 .. 2^-11) dominates.
#pragma once

#include <type_traits>

#include "fusekit/ops/glu.hpp"
#include "ops/common/activations.cuh"

namespace fk::device {

// 1 / (1 + 2^(-z log2 e)) with the MUFU ex2 and rcp approximations (flush-to-zero: a denormal
// 2^x only arises where the sigmoid is 1 to float precision anyway; 1 + 2^x = inf gives 0).
__device__ __forceinline__ float fast_sigmoid(float z) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.0f + e));
  return s;
}

__device__ __forceinline__ float fast_tanh(float z) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(z));
  return t;
}

template <Activation A, bool Fast>
__device__ __forceinline__ float act(float z) {
  if constexpr (!Fast || A == Activation::identity || A == Activation::relu || A == Activation::gelu_erf) {
    return activation<A>(z);
  } else if constexpr (A == Activation::sigmoid) {
    return fmaf(0.5f, fast_tanh(0.5f * z), 0.5f);
  } else if constexpr (A == Activation::tanh) {
    return fast_tanh(z);
  } else if constexpr (A == Activation::silu) {
    return z * fast_sigmoid(z);
  } else {
    static_assert(A == Activation::gelu_tanh);
    return z * fast_sigmoid(2.0f * kSqrt2OverPi * (z + kGeluC * z * z * z));
  }
}

template <Activation A, bool Fast>
__device__ __forceinline__ float act_grad(float z) {
  if constexpr (!Fast || A == Activation::identity || A == Activation::relu || A == Activation::gelu_erf) {
    return activation_grad<A>(z);
  } else if constexpr (A == Activation::sigmoid) {
    const float t = fast_tanh(0.5f * z);  // sigmoid' = s (1 - s) = (1 - t^2) / 4
    return 0.25f * fmaf(-t, t, 1.0f);
  } else if constexpr (A == Activation::tanh) {
    const float t = fast_tanh(z);
    return 1.0f - t * t;
  } else if constexpr (A == Activation::silu) {
    const float s = fast_sigmoid(z);
    return s * (1.0f + z * (1.0f - s));
  } else {
    static_assert(A == Activation::gelu_tanh);
    // With s = sigmoid(2u): gelu = z s, gelu' = s + z * 2 s (1 - s) u'.
    const float u2 = 2.0f * kSqrt2OverPi * (z + kGeluC * z * z * z);
    const float s = fast_sigmoid(u2);
    return s + z * 2.0f * s * (1.0f - s) * kSqrt2OverPi * (1.0f + 3.0f * kGeluC * z * z);
  }
}

template <GluKind K> struct GluParts;
template <> struct GluParts<GluKind::sigmoid_tanh> { static constexpr Activation gate = Activation::sigmoid, value = Activation::tanh; };
template <> struct GluParts<GluKind::swiglu> { static constexpr Activation gate = Activation::silu, value = Activation::identity; };
template <> struct GluParts<GluKind::geglu_tanh> { static constexpr Activation gate = Activation::identity, value = Activation::gelu_tanh; };
template <> struct GluParts<GluKind::geglu_erf> { static constexpr Activation gate = Activation::identity, value = Activation::gelu_erf; };
template <> struct GluParts<GluKind::reglu> { static constexpr Activation gate = Activation::relu, value = Activation::identity; };

template <GluKind K, bool Fast = false>
__device__ __forceinline__ float glu(float l, float r) {
  return act<GluParts<K>::gate, Fast>(l) * act<GluParts<K>::value, Fast>(r);
}

// (dl, dr) = g * (dglu/dl, dglu/dr) at (l, r).
template <GluKind K, bool Fast = false>
__device__ __forceinline__ void glu_grad(float l, float r, float g, float& dl, float& dr) {
  constexpr Activation G = GluParts<K>::gate, V = GluParts<K>::value;
  dl = g * act_grad<G, Fast>(l) * act<V, Fast>(r);
  dr = g * act<G, Fast>(l) * act_grad<V, Fast>(r);
}

// Calls f(std::integral_constant<GluKind, K>{}) for the runtime kind k (host or device).
template <class F>
__host__ __device__ __forceinline__ void with_glu_kind(GluKind k, F&& f) {
  switch (k) {
    case GluKind::sigmoid_tanh: return f(std::integral_constant<GluKind, GluKind::sigmoid_tanh>{});
    case GluKind::swiglu: return f(std::integral_constant<GluKind, GluKind::swiglu>{});
    case GluKind::geglu_tanh: return f(std::integral_constant<GluKind, GluKind::geglu_tanh>{});
    case GluKind::geglu_erf: return f(std::integral_constant<GluKind, GluKind::geglu_erf>{});
    case GluKind::reglu: return f(std::integral_constant<GluKind, GluKind::reglu>{});
  }
}

}  // namespace fk::device
