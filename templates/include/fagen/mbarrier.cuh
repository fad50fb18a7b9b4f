// fagen/mbarrier.cuh — shared-memory transaction barriers (sm_90; PTX ISA "Parallel
// Synchronization and Communication Instructions: mbarrier"):
//   mbarrier.init / arrive / arrive.expect_tx / expect_tx / complete_tx /
//   try_wait.parity, and fence.mbarrier_init.release.cluster.
//
// An mbarrier is a uint64_t in shared memory, 8-byte aligned. It has a current
// phase, an expected arrival count (init's `count`), the arrivals still pending
// in the phase and a tx-count (bytes of asynchronous copies still to land). The
// phase completes when no arrival is pending and the tx-count is zero; the
// barrier then moves to the next phase (its parity flips) and expects `count`
// arrivals again. mbarrier_wait_parity(bar, p) returns once the phase of parity p
// has completed: with the barrier in phase k, p = k & 1 waits for phase k, and
// p = (k & 1) ^ 1 names phase k - 1, already complete. So a pipeline waits on a
// stage's barrier with the parity of the round it is in, flipping it each time
// the ring wraps, and must never let a barrier run two phases ahead of a waiter.
//
// Init is made visible to other threads (and to the async proxy) by
// mbarrier_init_fence() in the initialising thread, then __syncthreads().
// arrive_expect_tx(bar, bytes) announces bytes that asynchronous copies (TMA) or
// mbarrier_complete_tx will deliver, then arrives.
//
// Emulated twins: fagen_emu::mbarrier_* (fagen/emulate/src/mbarrier.cpp), with
// the phase, arrival and tx-count rules checked; a wait blocks the emulated
// thread until the phase completes.
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::mbarrier_init(bar, count, FAGEN_CALL_SITE);
#else
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void mbarrier_init_fence(FAGEN_CALL_SITE_PARAMS_FIRST) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::mbarrier_init_fence(FAGEN_CALL_SITE);
#else
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Returns the state token of the phase the arrival counted towards.
__device__ __forceinline__ uint64_t mbarrier_arrive(uint64_t* bar FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  return ::fagen_emu::mbarrier_arrive(bar, FAGEN_CALL_SITE);
#else
  uint64_t state;
  asm volatile("mbarrier.arrive.shared.b64 %0, [%1];\n" : "=l"(state) : "r"(shared_address(bar)) : "memory");
  return state;
#endif
}

__device__ __forceinline__ uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  return ::fagen_emu::mbarrier_arrive_expect_tx(bar, tx_bytes, FAGEN_CALL_SITE);
#else
  uint64_t state;
  asm volatile("mbarrier.arrive.expect_tx.shared.b64 %0, [%1], %2;\n"
               : "=l"(state) : "r"(shared_address(bar)), "r"(tx_bytes) : "memory");
  return state;
#endif
}

__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::mbarrier_expect_tx(bar, tx_bytes, FAGEN_CALL_SITE);
#else
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
               ::"r"(shared_address(bar)), "r"(tx_bytes) : "memory");
#endif
}

// Delivers tx_bytes of the phase's tx-count, as a landing asynchronous copy does.
__device__ __forceinline__ void mbarrier_complete_tx(uint64_t* bar, uint32_t tx_bytes FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::mbarrier_complete_tx(bar, tx_bytes, FAGEN_CALL_SITE);
#else
  asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
               ::"r"(shared_address(bar)), "r"(tx_bytes) : "memory");
#endif
}

// One try: whether the phase of this parity has completed (the hardware may
// suspend the thread for a while before answering false).
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  return ::fagen_emu::mbarrier_try_wait_parity(bar, parity, FAGEN_CALL_SITE);
#else
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done) : "r"(shared_address(bar)), "r"(parity) : "memory");
  return done != 0;
#endif
}

// Waits until the phase of this parity has completed.
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::mbarrier_wait_parity(bar, parity, FAGEN_CALL_SITE);
#else
  while (!mbarrier_try_wait_parity(bar, parity)) {
  }
#endif
}

}  // namespace fagen
