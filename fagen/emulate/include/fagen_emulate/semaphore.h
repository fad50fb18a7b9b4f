// fagen_emulate/semaphore.h — the emulated twins of templates/include/fagen/semaphore.cuh: a
// counter in global memory that blocks take turns on (ld.acquire spin until *sem == value;
// red.release add 1). Kernels call the wrappers, never these directly.
//
// - semaphore_arrive adds 1 to the int atomically and wakes the blocks parked on semaphores. A
//   bulk operation of the caller's whose writes no wait_group (without .read) has retired is a
//   fault: the release would not order them (fagen_emulate/tma.h).
// - semaphore_wait_eq returns at once when *sem == value. Otherwise the calling thread blocks
//   ("semaphore wait" in deadlock messages); its block's other threads keep running. When none of
//   them can run, the block is parked: its OS thread stops running it until some block arrives on
//   a semaphore, then a waiter whose value is there becomes runnable (src/block_residency.cpp).
// - Counters only increase: a value past the awaited one, at the wait or while it blocks, is a
//   fault ("semaphore at ADDR is N, past the awaited M").
// - Resident blocks that all wait, with no arrive to come, are a deadlock naming every waiting
//   thread's semaphore, awaited value and current value (no block of the grid could ever wake them:
//   the grid's other blocks need a slot that none of them gives up).
// - Racecheck: an arrive releases the block's global writes, a wait that returns acquires them,
//   so a block's plain stores ordered after another's by a semaphore are not a hazard.
#pragma once

namespace fagen_emu {

FAGEN_EMU_RUNTIME_API void semaphore_wait_eq(const int* sem, int value, Site site);
// The same until *sem >= value: no value past it is a fault (the lanes of a warpgroup that all wait
// for one turn, some of them after that turn's arrive).
FAGEN_EMU_RUNTIME_API void semaphore_arrive(int* sem, Site site);

}  // namespace fagen_emu
