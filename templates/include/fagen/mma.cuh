// fagen/mma.cuh — tensor-core tile product, one warp:
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32
//
// acc (16x8, fp32) += A (16x16) * B (16x8), accumulated in place. All 32
// lanes of the warp must call it together (warp-collective; the emulator
// fails the launch otherwise).
//
// Fragments (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point
// type"). Per lane: g = lane >> 2 (group), t = lane % 4 (thread in group). A
// 32-bit register packs two 16-bit elements, the lower-indexed one in the
// low half.
//   a[i], i = 0..3: A[g + 8*(i % 2)][2t + 8*(i / 2) + {0, 1}]
//                   (a0: rows 0-7, cols 0-7; a1: rows 8-15, cols 0-7;
//                    a2: rows 0-7, cols 8-15; a3: rows 8-15, cols 8-15)
//   b[j], j = 0..1: B[2t + 8*j + {0, 1}][g]     (k runs along the register)
//   acc[e], e = 0..3: C[g + 8*(e / 2)][2t + e % 2]
// So a row of the accumulator lives in the four lanes 4g..4g+3.
//
// Emulated twin: fagen_emu::mma_m16n8k16 (fagen/emulate/src/tensor_core.cpp),
// same layouts; exact products summed in double, rounded to fp32 once.
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

__device__ __forceinline__ void mma_m16n8k16_f16(float acc[4], const uint32_t a[4],
                                                 const uint32_t b[2] FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::mma_m16n8k16(::fagen_emu::MmaInput::f16, acc, a, b, FAGEN_CALL_SITE);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float acc[4], const uint32_t a[4],
                                                  const uint32_t b[2] FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::mma_m16n8k16(::fagen_emu::MmaInput::bf16, acc, a, b, FAGEN_CALL_SITE);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

}  // namespace fagen
