// The warpgroup rendezvous: warps 4i..4i+3 of a block (threads 128i..128i+127) meet at one op
// and call site, as wgmma's .sync.aligned ops require. Same shape as the warp rendezvous
// (block_scheduler.cpp): arrive, park until the last thread arrives, which computes for all.
// Faults: a warpgroup the block does not fill, a thread arriving at another op or site while
// its warpgroup waits in one, a thread exiting or reaching __syncthreads while its warpgroup
// waits for it.
#include "runtime_internal.h"

#include <cstring>

namespace fagen_emu {
namespace {

bool same_site(Site a, Site b) {
  return a.line == b.line && (a.file == b.file || (a.file && b.file && std::strcmp(a.file, b.file) == 0));
}

std::string waiting_threads(const WarpgroupState& state, unsigned group) {
  std::vector<unsigned> ids;
  for (unsigned w = 0; w < 4; ++w)
    for (unsigned lane = 0; lane < 32; ++lane)
      if (state.arrived_lanes[w] >> lane & 1u) ids.push_back(128 * group + 32 * w + lane);
  return format_threads(ids);
}

bool has_arrived(const WarpgroupState& state, const Fiber& fiber) {
  return state.arrived_lanes[fiber.coords.warp % 4] >> fiber.coords.lane & 1u;
}

}  // namespace

void warpgroup_collective(const char* op, const void* in, void* out, WarpgroupCompute compute, Site site) {
  Fiber& self = *current_fiber;
  BlockRun& block = *self.block;
  const unsigned group = self.coords.warp / 4;
  WarpgroupState& state = block.warpgroups[group];
  if (block.thread_count < 128 * (group + 1)) {
    fail(site, "%s: warpgroup %u needs threads %u-%u, but the block has %u threads", op, group, 128 * group,
         128 * group + 127, block.thread_count);
  }
  for (unsigned w = 4 * group; w < 4 * group + 4; ++w) {
    if (block.live_lanes[w] != 0xffffffffu) {
      fail(site, "%s: lanes %s of warp %u have exited: a warpgroup op needs all 128 threads", op,
           format_lanes(~block.live_lanes[w]).c_str(), w);
    }
  }
  if (state.op == nullptr) {
    state.op = op;
    state.site = site;
  } else if (state.op != op || !same_site(state.site, site)) {
    fail(site, "%s called while threads %s of warpgroup %u wait in %s at %s: the warpgroup diverged at a "
               "warpgroup-collective op", op, waiting_threads(state, group).c_str(), group, state.op,
         format_site(state.site).c_str());
  }
  self.collective_in = in;
  self.collective_out = out;
  state.arrived_lanes[self.coords.warp % 4] |= 1u << self.coords.lane;
  if (++state.arrived < 128) {
    block_current(op, site);
    return;
  }
  WarpgroupRendezvous rendezvous;
  rendezvous.op = op;
  rendezvous.site = site;
  rendezvous.group = group;
  for (unsigned t = 0; t < 128; ++t) {
    const Fiber& fiber = block.fibers[128 * group + t];
    rendezvous.in[t] = fiber.collective_in;
    rendezvous.out[t] = fiber.collective_out;
  }
  state.op = nullptr;
  state.arrived = 0;
  std::memset(state.arrived_lanes, 0, sizeof state.arrived_lanes);
  block.idle_yields = 0;
  compute(rendezvous);
  for (unsigned t = 0; t < 128; ++t) {
    Fiber& fiber = block.fibers[128 * group + t];
    if (&fiber == &self) continue;
    fiber.state = FiberState::runnable;
    fiber.blocked_in = nullptr;
  }
}

std::string describe_warpgroup_waits(const BlockRun& block) {
  std::string message;
  for (unsigned group = 0; group < kMaxWarpgroups; ++group) {
    const WarpgroupState& state = block.warpgroups[group];
    if (state.op == nullptr) continue;
    message += " Warpgroup " + std::to_string(group) + ": threads " + waiting_threads(state, group) + " wait in " +
               state.op + " at " + format_site(state.site) + ".";
  }
  return message;
}

void warpgroup_check_exit(Fiber& fiber) {
  BlockRun& block = *fiber.block;
  const unsigned group = fiber.coords.warp / 4;
  const WarpgroupState& state = block.warpgroups[group];
  if (state.op != nullptr && !has_arrived(state, fiber)) {
    fail_current("exited, but threads " + waiting_threads(state, group) + " of warpgroup " + std::to_string(group) +
                 " wait for it in " + state.op + " at " + format_site(state.site) +
                 ": a warpgroup-collective op called by part of the warpgroup");
  }
}

void warpgroup_check_barrier(Site site) {
  const Fiber& fiber = *current_fiber;
  const unsigned group = fiber.coords.warp / 4;
  const WarpgroupState& state = fiber.block->warpgroups[group];
  if (state.op != nullptr && !has_arrived(state, fiber)) {
    fail(site, "__syncthreads reached while threads %s of warpgroup %u wait for this thread in %s at %s: a "
               "warpgroup-collective op called by part of the warpgroup",
         waiting_threads(state, group).c_str(), group, state.op, format_site(state.site).c_str());
  }
}

}  // namespace fagen_emu
