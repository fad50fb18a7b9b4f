// fagen/stmatrix.cuh — warp-collective stores of 8x8 b16 matrices from mma fragments to shared
// memory (sm_90): stmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16
//
// The counterpart of ldmatrix (fagen/ldmatrix.cuh), with the same layout (PTX ISA "Warp-level
// matrix store instruction: stmatrix"): lane 8k + r gives the row address (16 bytes, 16-byte
// aligned, shared memory) of row r of matrix k; x1 reads lanes 0-7's addresses, x2 lanes 0-15's,
// x4 all 32. Register k of lane l holds, low half first:
//   plain:  M_k[l / 4][2 (l % 4)],  M_k[l / 4][2 (l % 4) + 1]
//   .trans: M_k[2 (l % 4)][l / 4],  M_k[2 (l % 4) + 1][l / 4]
// so an accumulator row's pairs, converted to b16, store as rows of the output tile (a Hopper
// epilogue writes O to shared memory this way before its TMA store).
//
// Emulated twin: fagen_emu::stmatrix (fagen/emulate/src/stmatrix.cpp).
#pragma once

#include <fagen/prelude.cuh>

#ifdef FAGEN_EMULATE
#include <fagen_emulate/stmatrix.h>
#endif

namespace fagen {

__device__ __forceinline__ void stmatrix_x1(void* row, const uint32_t regs[1] FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::stmatrix(1, false, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};\n" ::"r"(shared_address(row)), "r"(regs[0])
               : "memory");
#endif
}

__device__ __forceinline__ void stmatrix_x2(void* row, const uint32_t regs[2] FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::stmatrix(2, false, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n" ::"r"(shared_address(row)),
               "r"(regs[0]), "r"(regs[1]) : "memory");
#endif
}

__device__ __forceinline__ void stmatrix_x4(void* row, const uint32_t regs[4] FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::stmatrix(4, false, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(shared_address(row)),
               "r"(regs[0]), "r"(regs[1]), "r"(regs[2]), "r"(regs[3]) : "memory");
#endif
}

__device__ __forceinline__ void stmatrix_x4_trans(void* row, const uint32_t regs[4] FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::stmatrix(4, true, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(shared_address(row)), "r"(regs[0]), "r"(regs[1]), "r"(regs[2]), "r"(regs[3]) : "memory");
#endif
}

}  // namespace fagen
