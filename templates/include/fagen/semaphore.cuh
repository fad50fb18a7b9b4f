// fagen/semaphore.cuh — a global-memory semaphore that orders work across thread blocks (sm_90;
// PTX ISA "Memory Consistency Model": the acquire and release patterns, "Data Movement and
// Conversion Instructions: ld" with .acquire, "Parallel Synchronization and Communication
// Instructions: red" with .release, and "membar / fence" for fence.proxy.async.global):
//   semaphore_wait_eq(sem, value)   ld.acquire.gpu.global.b32 until *sem == value,
//                                   then fence.proxy.async.global
//   semaphore_arrive(sem)           fence.proxy.async.global, then red.release.gpu.global.add.s32 +1
//
// Why: a deterministic reduction across blocks (FlashAttention-3's dQ) makes the blocks that add
// into one tile take turns in a fixed order. Block j's single thread spins until the tile's
// counter equals its turn, reduces, waits for its writes (bulk_wait_group<0>, fagen/tma.cuh) and
// increments the counter. The acquire load makes the previous block's writes visible to the
// generic proxy; the proxy fence after it orders this thread's later async-proxy operations (a
// cp.reduce.async.bulk) after the acquire, since the async proxy does not follow the generic
// proxy's ordering. On the arrive side the fence orders the async proxy's completed writes with
// the release (the ISA's cumulativity covers the generic proxy only), and the release makes the
// caller's earlier writes, and those its earlier barriers ordered before it, visible before the
// increment. Counters only increase: a value past the awaited one never comes back.
//
// Emulated twins: fagen_emu::semaphore_wait_eq / semaphore_arrive (fagen/emulate/src/semaphore.cpp):
// a wait blocks the calling thread (its block's other threads keep running; a block none of whose
// threads can run is parked until some block arrives), a value past the awaited one is a fault,
// and blocks that all wait for each other are reported as a deadlock rather than hanging.
#pragma once

#include <fagen/prelude.cuh>

#ifdef FAGEN_EMULATE
#include <fagen_emulate/semaphore.h>
#endif

namespace fagen {

// Spins until *sem == value (acquire), then orders the caller's later async-proxy operations after it.
__device__ __forceinline__ void semaphore_wait_eq(const int* sem, int value FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::semaphore_wait_eq(sem, value, FAGEN_CALL_SITE);
#else
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
  } while (seen != value);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// *sem += 1 (release): the caller's earlier writes, and those of the bulk groups a
// bulk_wait_group<0> has completed, are visible before the increment.
__device__ __forceinline__ void semaphore_arrive(int* sem FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::semaphore_arrive(sem, FAGEN_CALL_SITE);
#else
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(sem), "r"(1) : "memory");
#endif
}

}  // namespace fagen
