// fagen/numeric.cuh — element types and the float conversions every kernel uses.
//
// Kernels compute in fp32 and store fp16 or bf16. The conversions round to
// nearest even on the GPU and in the emulator alike (the emulator uses the
// same cuda_fp16.h / cuda_bf16.h on the host).
#pragma once

// Full unrolling of loops over register arrays: an array indexed by a loop
// that is not unrolled lives in local memory (stack), not registers.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FAGEN_UNROLL _Pragma("unroll")
#else
#define FAGEN_UNROLL
#endif

namespace fagen {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 2^x on the special-function unit: ex2.approx.ftz.f32, one MUFU.EX2, within a few ulp
// (the PTX ISA's ex2.approx bound); results below 2^-126 are flushed to zero. exp2f
// keeps those subnormal results at the price of a range test and two multiplies per
// call, which the softmax does not need: a probability below 2^-126 is lost in P V anyway.
// Emulated twin: the host's exp2f, with subnormal results flushed to zero likewise.
__device__ __forceinline__ float exp2_approx(float x) {
#ifdef FAGEN_EMULATE
  const float result = exp2f(x);
  return result < 1.17549435e-38f ? 0.f : result;  // FLT_MIN: the smallest normal float
#else
  float result;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(x));
  return result;
#endif
}

// tanh on the special-function unit: tanh.approx.f32, one MUFU.TANH (sm_75 on), where tanhf
// costs some twenty instructions. The PTX ISA bounds its relative error by 2^-10.987 (about
// 4.93e-4); the softcap (c tanh(s / c)) uses it, as FlashAttention-2's does. Emulated twin: the
// host's tanhf moved by that whole bound, up or down by the input's last bit, and kept within
// [-1, 1]. It errs as much as the ISA allows, so a tolerance that holds on the emulator holds on
// any GPU that meets the ISA (one measured on sm_75 stays within 1.2e-5).
constexpr float kTanhApproxRelError = 4.92701e-4f;  // 2^-10.987, the PTX ISA's bound for tanh.approx.f32

__device__ __forceinline__ float tanh_approx(float x) {
#ifdef FAGEN_EMULATE
  const float exact = tanhf(x);
  const float moved = exact * (1.f + ((__float_as_uint(x) & 1u) ? kTanhApproxRelError : -kTanhApproxRelError));
  return fabsf(moved) > 1.f ? copysignf(1.f, moved) : moved;  // NaN stays NaN
#else
  float result;
  asm("tanh.approx.f32 %0, %1;" : "=f"(result) : "f"(x));
  return result;
#endif
}

// +infinity without <math.h>, which NVRTC does not provide.
__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }

// Sixteen bytes moved as one unit: with 16-byte alignment the compiler emits
// one 128-bit load or store (LDG.128 / STG.128 / LDS.128).
struct __align__(16) Chunk16 {
  unsigned w[4];
};

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * log2(e))
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): back from log2 units to natural log

}  // namespace fagen
