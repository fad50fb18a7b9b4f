// fagen/named_barrier.cuh — named barriers (PTX ISA "Parallel Synchronization and
// Communication Instructions: bar, barrier"): bar.sync id, count; bar.arrive id, count.
//
// A block has 16 barriers, ids 0-15. `count` threads (a nonzero multiple of 32:
// whole warps arrive) take part in one use; bar.sync waits until all have
// arrived, bar.arrive counts without waiting (a producer signalling consumers).
// All warps of one use name the same count. Barrier 0 with the whole block is
// __syncthreads. The calls are per warp (.aligned): every lane of a warp makes
// the same one.
//
// Emulated twins: fagen_emu::named_barrier_sync / _arrive
// (fagen/emulate/src/named_barrier.cpp).
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t count FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::named_barrier_sync(id, count, FAGEN_CALL_SITE);
#else
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t count FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::named_barrier_arrive(id, count, FAGEN_CALL_SITE);
#else
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#endif
}

}  // namespace fagen
