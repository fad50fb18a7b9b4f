// fagen_emulate/warp_specialize.h — the emulated twins of the wrappers a
// warp-specialised kernel uses besides mbarriers: templates/include/fagen/
// {named_barrier,elect,warpgroup_control,proxy_fence}.cuh. Kernels call the
// wrappers, never these directly.
//
// - named barriers (bar.sync / bar.arrive id, count; src/named_barrier.cpp):
//   ids 0-15, count a nonzero multiple of 32; a warp counts once all its live
//   lanes arrived; the barrier completes at `count` threads; bar.sync 0 with the
//   whole block is __syncthreads. Mismatched counts, too many warps and a barrier
//   that never completes are faults. Racecheck orders threads by them (happens-before).
// - elect.sync: warp-collective over the mask; one lane is elected, the same for
//   the same mask every time (the ISA's rule); the twin picks the lowest lane.
// - setmaxnreg.{inc,dec}.sync.aligned.u32 N: all live threads of the warpgroup
//   (warps 4g..4g+3) at the same instruction; N in [24, 256], a multiple of 8.
// - fence.proxy.async: recorded and counted (LaunchCounters::proxy_fences).
#pragma once

namespace fagen_emu {

FAGEN_EMU_RUNTIME_API void named_barrier_sync(unsigned id, unsigned count, Site site);
FAGEN_EMU_RUNTIME_API void named_barrier_arrive(unsigned id, unsigned count, Site site);
FAGEN_EMU_RUNTIME_API unsigned elect_sync(unsigned mask, Site site);  // the elected lane
FAGEN_EMU_RUNTIME_API void setmaxnreg_inc(unsigned registers, Site site);
FAGEN_EMU_RUNTIME_API void setmaxnreg_dec(unsigned registers, Site site);
FAGEN_EMU_RUNTIME_API void fence_proxy_async(Site site);

}  // namespace fagen_emu
