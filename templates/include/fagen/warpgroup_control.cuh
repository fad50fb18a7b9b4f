// fagen/warpgroup_control.cuh — per-warpgroup register budgets (sm_90a; PTX ISA
// "Miscellaneous Instructions: setmaxnreg"):
//   setmaxnreg.inc.sync.aligned.u32 N;  setmaxnreg.dec.sync.aligned.u32 N;
//
// A warpgroup is four consecutive warps (warp index / 4). All its warps execute
// the same setmaxnreg together; N is the new per-thread register maximum, in
// [24, 256] and a multiple of 8. .dec releases registers (a producer warpgroup
// going down to 24 to 40), .inc claims them (consumers going up to 232 or 240)
// and waits until enough are free. FlashAttention-3's d128 kernels use 24 / 240.
//
// Emulated twins: fagen_emu::setmaxnreg_inc / _dec
// (fagen/emulate/src/warp_specialize.cpp): a warpgroup rendezvous that checks these rules.
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

template <int N>
__device__ __forceinline__ void setmaxnreg_inc(FAGEN_CALL_SITE_PARAMS_FIRST) {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg takes 24..256 registers, a multiple of 8");
#ifdef FAGEN_EMULATE
  ::fagen_emu::setmaxnreg_inc(N, FAGEN_CALL_SITE);
#else
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

template <int N>
__device__ __forceinline__ void setmaxnreg_dec(FAGEN_CALL_SITE_PARAMS_FIRST) {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg takes 24..256 registers, a multiple of 8");
#ifdef FAGEN_EMULATE
  ::fagen_emu::setmaxnreg_dec(N, FAGEN_CALL_SITE);
#else
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

}  // namespace fagen
