// fagen_emulate/mbarrier.h — the emulated twins of templates/include/fagen/mbarrier.cuh
// (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier").
// Kernels call the wrappers, never these directly.
//
// An mbarrier is an 8-byte object in shared memory. The runtime keeps its state
// beside the memory (src/mbarrier.cpp), per block, keyed by its address:
// - the current phase (its parity is what try_wait.parity tests), the expected
//   arrival count (set by init, reloaded when a phase completes), the pending
//   arrivals and the tx-count of the current phase;
// - a phase completes when its pending arrivals reach zero and its tx-count is
//   zero; the barrier then moves to the next phase;
// - try_wait.parity(p) succeeds when the phase with parity p has completed, i.e.
//   the current phase's parity is not p. A waiting thread blocks, and is
//   released when the phase completes.
// Faults (EmulationError naming the thread, the barrier and the .cu line): a use
// before init, or before the init is visible to the user (init by another thread
// needs fence.mbarrier_init by the initialising thread, then __syncthreads); an
// arrival beyond the expected count; a tx-count outside [-(2^20-1), 2^20-1]; a
// counting thread that lets the barrier complete two phases between its waits
// (the parity it waits for is ambiguous: the ABA problem); a wait that can never
// complete (a deadlock naming the barrier, the parity and the waiting threads).
#pragma once

#include <cstdint>

namespace fagen_emu {

FAGEN_EMU_RUNTIME_API void mbarrier_init(void* bar, uint32_t expected_count, Site site);
// fence.mbarrier_init.release.cluster: the calling thread's earlier inits become
// visible to the threads that pass a later __syncthreads with it.
FAGEN_EMU_RUNTIME_API void mbarrier_init_fence(Site site);
// Returns the state token (the phase the arrival counted towards).
FAGEN_EMU_RUNTIME_API uint64_t mbarrier_arrive(void* bar, Site site);
FAGEN_EMU_RUNTIME_API uint64_t mbarrier_arrive_expect_tx(void* bar, uint32_t tx_bytes, Site site);
FAGEN_EMU_RUNTIME_API void mbarrier_expect_tx(void* bar, uint32_t tx_bytes, Site site);
// mbarrier.complete_tx, and what an asynchronous copy (TMA) calls when its bytes land.
FAGEN_EMU_RUNTIME_API void mbarrier_complete_tx(void* bar, uint32_t tx_bytes, Site site);
// One try_wait.parity: true if the phase with this parity has completed; false
// after letting the block's other threads run once (the try's time limit).
FAGEN_EMU_RUNTIME_API bool mbarrier_try_wait_parity(void* bar, uint32_t parity, Site site);
// A try_wait.parity loop: blocks until the phase with this parity has completed.
FAGEN_EMU_RUNTIME_API void mbarrier_wait_parity(void* bar, uint32_t parity, Site site);

}  // namespace fagen_emu
