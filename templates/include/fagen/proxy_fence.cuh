// fagen/proxy_fence.cuh — fence.proxy.async (sm_90; PTX ISA "Parallel
// Synchronization and Communication Instructions: membar / fence", proxy fences).
//
// Generic-proxy accesses (plain loads and stores) and async-proxy ones (TMA,
// wgmma reading shared memory) are not ordered with each other. A thread that
// writes shared memory with plain stores which a TMA store or a wgmma then reads
// runs fence_proxy_async_shared() between the two (and the other threads reach
// it through a barrier).
//
// Emulated twin: fagen_emu::fence_proxy_async (fagen/emulate/src/warp_specialize.cpp):
// recorded and counted (LaunchCounters::proxy_fences), for racecheck's proxy rules.
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

// fence.proxy.async: every state space.
__device__ __forceinline__ void fence_proxy_async(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::fence_proxy_async(FAGEN_CALL_SITE);
#else
  asm volatile("fence.proxy.async;\n" ::: "memory");
#endif
}

// fence.proxy.async.shared::cta: the block's shared memory only.
__device__ __forceinline__ void fence_proxy_async_shared(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::fence_proxy_async(FAGEN_CALL_SITE);
#else
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

}  // namespace fagen
