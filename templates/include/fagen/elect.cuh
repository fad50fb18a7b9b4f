// fagen/elect.cuh — elect.sync (sm_90; PTX ISA "Parallel Synchronization and
// Communication Instructions: elect.sync"): one lane of `mask` is elected.
//
// Warp-collective: every lane of `mask` calls it together. elect_one_sync is
// true in the elected lane only (the emulator elects the lowest lane of the
// mask); use it where one thread of a warp must act (an mbarrier arrival, a TMA
// issue) after the warp agreed with __syncwarp.
//
// Emulated twin: fagen_emu::elect_sync (fagen/emulate/src/warp_specialize.cpp).
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

__device__ __forceinline__ bool elect_one_sync(uint32_t mask = 0xffffffffu FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  return ::fagen_emu::elect_sync(mask, FAGEN_CALL_SITE) == threadIdx.x % 32;
#else
  uint32_t elected;
  asm volatile(
      "{\n"
      ".reg .b32 leader;\n"
      ".reg .pred p;\n"
      "elect.sync leader|p, %1;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(elected) : "r"(mask));
  return elected != 0;
#endif
}

}  // namespace fagen
