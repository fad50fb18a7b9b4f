// Named barriers (fagen_emulate/warp_specialize.h): bar.sync id, count and
// bar.arrive id, count (PTX ISA, "Parallel Synchronization and Communication
// Instructions: bar, barrier").
//
// The ISA's rules this follows: a block has 16 barriers, ids 0 to 15; `count`
// is a nonzero multiple of the warp size; the barrier counts arrivals per warp
// (a warp adds the warp size, exited lanes included), and completes when
// `count` threads have arrived: the threads waiting in bar.sync go on and the
// barrier is reset for its next use. bar.arrive counts without waiting. Every
// arrival at one barrier in one use names the same count. __syncthreads is
// barrier 0 with every thread of the block: bar.sync 0 with the block's thread
// count (rounded up to whole warps) is the block barrier itself, so kernels may
// mix the two; any other use of barrier 0 must not overlap a __syncthreads.
//
// A warp's arrival counts once all its live lanes have arrived (the .aligned
// form: a warp arrives as a whole); a warp beyond the `count` threads already
// arriving is a fault, as are a thread arriving twice in one use, mismatched
// counts and a count that is not a multiple of 32. A bar.sync that can never complete is a deadlock that names
// the barrier.
#include "runtime_internal.h"

namespace fagen_emu {
namespace {

constexpr unsigned kNamedBarriers = 16;
const char kBarSync[] = "bar.sync";
const char kBarArrive[] = "bar.arrive";

struct NamedBarrier {
  unsigned count = 0;          // of the use in progress; 0: idle
  Site site{};                 // the first arrival's
  const char* first_op = nullptr;
  unsigned lanes[32] = {};     // per warp: lanes arrived
  unsigned waiting[32] = {};   // per warp: lanes blocked in bar.sync
  unsigned warps_started = 0;  // warps with an arrived lane
  unsigned warps_done = 0;     // warps all of whose live lanes arrived
};

thread_local NamedBarrier barriers[kNamedBarriers];

void check_operands(const char* op, unsigned id, unsigned count, Site site) {
  const BlockRun& block = *current_fiber->block;
  if (id >= kNamedBarriers) fail(site, "%s %u, %u: the barrier id must be in [0, 15]", op, id, count);
  if (count == 0 || count % 32 != 0) {
    fail(site, "%s %u, %u: the thread count must be a nonzero multiple of the warp size (32)", op, id, count);
  }
  if (count > block.warp_count * 32) {
    fail(site, "%s %u, %u: the count exceeds the block's %u threads (%u warps), so the barrier can never "
               "complete", op, id, count, block.thread_count, block.warp_count);
  }
}

// Barrier 0 in use as a named barrier must not meet a pending __syncthreads.
void check_block_barrier_idle(const char* op, unsigned id, unsigned count, Site site) {
  const BlockRun& block = *current_fiber->block;
  if (id == 0 && block.barrier_arrived > 0) {
    fail(site, "%s 0, %u while threads wait at __syncthreads (barrier 0 with all %u threads) at %s: mismatched "
               "thread counts on barrier 0", op, count, block.thread_count, format_site(block.barrier_site).c_str());
  }
}

void complete(NamedBarrier& b) {
  BlockRun& block = *current_fiber->block;
  named_barrier_completed(static_cast<unsigned>(&b - barriers), b.waiting);
  bool released = false;
  for (unsigned w = 0; w < block.warp_count; ++w) {
    for (unsigned lanes = b.waiting[w]; lanes; lanes &= lanes - 1) {
      Fiber& fiber = block.fibers[w * 32 + static_cast<unsigned>(__builtin_ctz(lanes))];
      if (&fiber == current_fiber) continue;
      fiber.state = FiberState::runnable;
      fiber.blocked_in = nullptr;
      released = true;
    }
  }
  b = NamedBarrier{};
  block.idle_yields = 0;
  if (released) reschedule_after_release();
}

void arrive(const char* op, unsigned id, unsigned count, bool wait, Site site) {
  check_operands(op, id, count, site);
  check_block_barrier_idle(op, id, count, site);
  Fiber& self = *current_fiber;
  BlockRun& block = *self.block;
  const unsigned warp = self.coords.warp, bit = 1u << self.coords.lane;
  NamedBarrier& b = barriers[id];
  if (b.count == 0) {
    b.count = count;
    b.site = site;
    b.first_op = op;
  } else if (b.count != count) {
    fail(site, "%s %u, %u while barrier %u is in use with count %u (%s at %s): mismatched thread counts on one "
               "barrier", op, id, count, id, b.count, b.first_op, format_site(b.site).c_str());
  }
  if (b.lanes[warp] & bit) {
    fail(site, "%s %u, %u: this thread already arrived at barrier %u (%s at %s), which has not completed since "
               "(%u of %u threads counted): an arrival twice in one use of the barrier", op, id, count, id,
         b.first_op, format_site(b.site).c_str(), b.warps_done * 32, count);
  }
  if (b.lanes[warp] == 0) {
    if ((b.warps_started + 1) * 32 > count) {
      fail(site, "%s %u, %u: warp %u arrives while %u warps already make up the barrier's %u threads (the "
                 "barrier has not completed: some of their lanes are still to arrive)",
           op, id, count, warp, b.warps_started, count);
    }
    b.warps_started += 1;
  }
  b.lanes[warp] |= bit;
  named_barrier_arrived(id);
  if (wait) b.waiting[warp] |= bit;
  // Lanes that arrived and have since exited still count (a warp arrives as a whole): the warp is
  // done once every lane still alive has arrived.
  const unsigned live = block.live_lanes[warp];
  if ((b.lanes[warp] & live) == live && (b.warps_done += 1) * 32 == count) {
    complete(b);
    return;
  }
  if (wait) block_current(kBarSync, site);
}

}  // namespace

void named_barrier_sync(unsigned id, unsigned count, Site site) {
  const BlockRun& block = *current_fiber->block;
  if (id == 0 && count == block.warp_count * 32) {
    sync_threads(site);  // __syncthreads is bar.sync 0 with every thread
    return;
  }
  arrive(kBarSync, id, count, /*wait=*/true, site);
}

void named_barrier_arrive(unsigned id, unsigned count, Site site) {
  arrive(kBarArrive, id, count, /*wait=*/false, site);
}

void check_named_barrier_zero_idle(Site site) {
  const NamedBarrier& b = barriers[0];
  if (b.count != 0) {
    fail(site, "__syncthreads (barrier 0 with all %u threads) while barrier 0 is in use with count %u (%s at "
               "%s): mismatched thread counts on barrier 0", current_fiber->block->thread_count, b.count, b.first_op,
         format_site(b.site).c_str());
  }
}

void named_barrier_block_start() {
  for (NamedBarrier& b : barriers) b = NamedBarrier{};
}

std::string describe_named_barrier_waits(const BlockRun& block) {
  std::string text;
  for (unsigned id = 0; id < kNamedBarriers; ++id) {
    const NamedBarrier& b = barriers[id];
    if (b.count == 0) continue;
    std::vector<unsigned> waiting, arrived;
    for (unsigned w = 0; w < block.warp_count; ++w) {
      for (unsigned lane = 0; lane < 32; ++lane) {
        if (b.waiting[w] >> lane & 1u) waiting.push_back(w * 32 + lane);
        if (b.lanes[w] >> lane & 1u) arrived.push_back(w * 32 + lane);
      }
    }
    text += " Named barrier " + std::to_string(id) + " (count " + std::to_string(b.count) + ", first " +
            b.first_op + " at " + format_site(b.site) + "): threads " + format_threads(arrived) +
            " arrived, threads " + format_threads(waiting) + " wait in bar.sync, " +
            std::to_string(b.warps_done * 32) + " of " + std::to_string(b.count) + " threads counted.";
  }
  return text;
}

}  // namespace fagen_emu
