// fagen/fp8_cache.cuh — an 8-bit KV cache under fp16 or bf16 queries (Spec.cache_dtype, decoding).
//
// As vLLM and FlashInfer serve it: the cache holds e4m3 bytes, k_cache = k_descale * K8 and
// v_cache = v_descale * V8 with one fp32 descale per (batch entry, K/V head), and q stays in
// elem_t (fp16 or bf16). A decoding step is bound by the bytes it reads, which the cache halves;
// its mmas stay elem_t x elem_t:
//   - the append quantises each new key and value once, e4m3(x / descale), rounded to nearest
//     and saturated at +-448 (`to_e4m3`);
//   - each K/V tile lands in shared memory as bytes (cp.async, a byte per element) and is
//     widened there to elem_t (`widen_tile`). The widening is exact: every e4m3 value is an
//     fp16 and a bf16 value (3 mantissa bits, exponents 2^-9 .. 2^8), NaN stays NaN;
//   - the descales are applied in fp32 where they act on whole scores and rows: S = q K8^T times
//     k's descale before any variant sees it, O times v's before its normalisation.
// The conversions are cuda_fp8.h's (cvt with .satfinite, and e4m3x2 -> f16x2, in hardware from
// sm_89, by its own arithmetic below it and in the emulator's host code); tests check them against
// torch's float8 casts (tests/emulate/test_emulate_fp8.py, tests/kernels/test_fp8_cache.py).
#pragma once

#include <fagen/prelude.cuh>
#include <fagen/numeric.cuh>
#include <fagen/warp_tile.cuh>   // pack2
#include <cuda_fp8.h>

namespace fagen {

using e4m3_t = __nv_fp8_storage_t;   // one e4m3 byte, as cuda_fp8.h stores it

__device__ __forceinline__ e4m3_t to_e4m3(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// Two e4m3 bytes (`lo` in the low byte) as two elem_t, packed as an mma operand register is: for
// bf16 through fp32 (e4m3 -> f16x2, two f16 -> f32, one f32x2 -> bf16x2: four instructions a pair
// on sm_90's SASS); for fp16 the f16x2 is the operand already (one).
template <class T>
__device__ __forceinline__ uint32_t widen_e4m3x2(uint16_t pair) {
  const float2 wide = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
  return pack2<T>(wide.x, wide.y);
}
template <>
__device__ __forceinline__ uint32_t widen_e4m3x2<__half>(uint16_t pair) {
  const __half2_raw wide = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
  return static_cast<uint32_t>(wide.x) | static_cast<uint32_t>(wide.y) << 16;
}

// A tile of kRows rows of e4m3 (rows kRawRowBytes apart, kHeadDimPad bytes each: the padding
// columns are the copy's zeros) widened into elem_t rows kRowElems apart. Each thread takes
// 16 bytes at a time: one 16-byte load, two 16-byte stores.
template <int kRows, int kHeadDimPad, int kRawRowBytes, int kRowElems, int kThreads, class T>
__device__ __forceinline__ void widen_tile(T* tile, const e4m3_t* raw) {
  constexpr int kChunksPerRow = kHeadDimPad / 16;
  static_assert(kHeadDimPad % 16 == 0 && kRawRowBytes % 16 == 0 && kRowElems % 8 == 0, "16-byte chunks");
  FAGEN_UNROLL
  for (int chunk = threadIdx.x; chunk < kRows * kChunksPerRow; chunk += kThreads) {
    const int row = chunk / kChunksPerRow, col = chunk % kChunksPerRow * 16;
    const uint4 bytes = *reinterpret_cast<const uint4*>(raw + row * kRawRowBytes + col);
    const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    uint32_t wide[8];
    FAGEN_UNROLL
    for (int w = 0; w < 4; ++w) {
      wide[2 * w] = widen_e4m3x2<T>(static_cast<uint16_t>(words[w] & 0xffffu));
      wide[2 * w + 1] = widen_e4m3x2<T>(static_cast<uint16_t>(words[w] >> 16));
    }
    uint4* out = reinterpret_cast<uint4*>(tile + row * kRowElems + col);
    out[0] = make_uint4(wide[0], wide[1], wide[2], wide[3]);
    out[1] = make_uint4(wide[4], wide[5], wide[6], wide[7]);
  }
}

// Every element of a register fragment times `descale` (S by k's, O by v's).
template <int kA, int kB, int kC>
__device__ __forceinline__ void descale_all(float (&x)[kA][kB][kC], float descale) {
  FAGEN_UNROLL
  for (int a = 0; a < kA; ++a)
    FAGEN_UNROLL
    for (int b = 0; b < kB; ++b)
      FAGEN_UNROLL
      for (int c = 0; c < kC; ++c) x[a][b][c] *= descale;
}

}  // namespace fagen
