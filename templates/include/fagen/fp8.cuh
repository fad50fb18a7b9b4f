// fagen/fp8.cuh — 8-bit floats for the fp8 kernels (sm_89 on; the sm90 family's e4m3 wgmma):
// conversion with saturation, and P packed as the A operand of a k32 wgmma.
//
// Conversion: round to nearest even, saturating to the largest finite value (e4m3 +-448, e5m2
// +-57344; an infinity saturates too) and keeping NaN a NaN: cvt.rn.satfinite.{e4m3,e5m2}x2.f32,
// through NVIDIA's cuda_fp8.h, whose host code is the emulator's twin (a reading independent of
// both: tests/emulate/test_emulate_fp8.py, against torch's float8 casts of the clamped value).
//
// P as wgmma's A. An m64nN fp32 accumulator (fagen/wgmma.cuh) gives thread q of a quad the
// columns 8 j + 2 q and 8 j + 2 q + 1 of each 8-column block j; an 8-bit A fragment of a k32
// step wants k = 16 h + 4 q .. 16 h + 4 q + 3 of it (register r: half h = r / 2). The two
// differ by a permutation of each 16 keys, which costs nothing if V's rows (B's k) are put in the
// same order: P V sums over the keys, in any order. So `pack_p` packs, with no data movement, the
// accumulator's columns
//     8 j + 2 q, 8 j + 2 q + 1, 8 (j + 1) + 2 q, 8 (j + 1) + 2 q + 1     (j = 2 h of the step)
// into k slots 4 q .. 4 q + 3 of the 16 keys of h: slot s of a group of 16 holds key
//     key_of_slot(s) = 2 (s / 4) + s % 2 + 8 (s % 4 / 2),
// and the V^T tile (K-major: a row per column of V, keys along it) must hold key k of a group at
// slot slot_of_key(k), its inverse (FlashAttention-3 reorders V's keys as it transposes it).
#pragma once

#include <fagen/prelude.cuh>
#include <fagen/numeric.cuh>   // FAGEN_UNROLL
#include <cuda_fp8.h>

namespace fagen {

// P's scale in the 8-bit forward: P~ = 2^kPExponent exp(S - m) puts a row's largest P at 256, the
// largest power of two below e4m3's 448 (a power of two: the scaling is exact), and keeps every P
// down to 2^-17 above e4m3's smallest subnormal (2^-9); fagen/reference/same_fp8.py derives and
// tests it. The row sum and O carry the same 2^kPExponent, which kPScaleInverse takes back.
constexpr int kPExponent = 8;
constexpr float kPScale = 1 << kPExponent;
constexpr float kPScaleInverse = 1.f / kPScale;

// Two floats as two e4m3 (e5m2) bytes, `lo` in the low byte.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ uint16_t e5m2x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E5M2);
}

// Four floats as four e4m3 bytes of one register, `a` in the lowest. On the GPU, one asm: two
// conversions into 16-bit registers and mov.b32 {lo, hi}, which ptxas folds into one
// F2FP.SATFINITE...MERGE_C per pair (e4m3x2's results joined by a shift and an or cost a PRMT per
// register besides). ptxas 12.9 folds it outside the forward's loop only, and joins the pairs with
// a PRMT inside it whatever the PTX's form (benchmarks/RESULTS.md); 13.x folds it there too. The
// operands' order, by the PTX ISA: cvt.rn.satfinite.e4m3x2.f32 d, a, b puts
// a's byte in d's upper half and b's in its lower (as cuda_fp8.hpp's own cvt, `%0, %2, %1` for
// (x, y), reads it), and mov.b32's vector {lo, hi} puts its first element in the low bits. The
// emulator joins e4m3x2's halves by that arithmetic: the twin.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
#ifdef FAGEN_EMULATE
  return static_cast<uint32_t>(e4m3x2(a, b)) | static_cast<uint32_t>(e4m3x2(c, d)) << 16;
#else
  uint32_t packed;
  asm("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(packed)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return packed;
#endif
}

// Where the 16 keys of a group go in a k32 A fragment built by pack_p (above), and back.
__host__ __device__ constexpr int key_of_slot(int slot) { return 2 * (slot / 4) + slot % 2 + 8 * (slot % 4 / 2); }
__host__ __device__ constexpr int slot_of_key(int key) { return 4 * (key % 8 / 2) + key % 2 + 2 * (key / 8); }
static_assert(slot_of_key(key_of_slot(5)) == 5 && key_of_slot(slot_of_key(11)) == 11, "inverse orders");

// An m64 x kCols fp32 accumulator (P, already scaled into e4m3's range) as the kCols / 32 k32
// steps of A registers of the product P V, in e4m3; its keys in the order above.
template <int kCols>
__device__ __forceinline__ void pack_p(const float (&p)[kCols / 2], uint32_t (&a)[kCols / 32][4]) {
  static_assert(kCols % 32 == 0, "whole k32 steps");
  FAGEN_UNROLL
  for (int step = 0; step < kCols / 32; ++step) {
    FAGEN_UNROLL
    for (int r = 0; r < 4; ++r) {
      // Register r: rows 8 (r % 2) further (the accumulator's i / 2 % 2), keys 16 (r / 2) on.
      const int i = 4 * (4 * step + 2 * (r / 2)) + 2 * (r % 2);   // block j's first of the row
      a[step][r] = e4m3x4(p[i], p[i + 1], p[i + 4], p[i + 5]);
    }
  }
}

}  // namespace fagen
