// elect.sync, setmaxnreg and fence.proxy.async twins (fagen_emulate/warp_specialize.h).
//
// elect.sync (PTX ISA, "Parallel Synchronization and Communication Instructions:
// elect.sync"): warp-collective over `membermask`; one lane is elected, the
// lowest-numbered lane of the mask here (the ISA's example elects the leader that
// way; the ISA only promises one lane).
//
// setmaxnreg (PTX ISA, "Miscellaneous Instructions: setmaxnreg"):
// .sync.aligned: every warp of the warpgroup (four consecutive warps, warp / 4)
// executes the same setmaxnreg; the register count is an immediate in [24, 256]
// and a multiple of 8; .inc raises the per-thread maximum to it, .dec lowers it.
// The twin is a rendezvous of the warpgroup's live threads, and checks those
// rules and, once the warpgroup has a count from an earlier setmaxnreg, that .inc
// does not lower it and .dec does not raise it.
//
// fence.proxy.async: orders the generic proxy's shared-memory accesses against
// the async proxy's (TMA, wgmma operands). The twin records the fence (counted
// per launch); racecheck orders async-proxy reads after generic writes by it.
#include "runtime_internal.h"

namespace fagen_emu {
namespace {

constexpr unsigned kWarpgroups = kMaxThreadsPerBlock / 128;
const char kElect[] = "elect.sync";
const char kSetmaxnregInc[] = "setmaxnreg.inc.sync.aligned.u32";
const char kSetmaxnregDec[] = "setmaxnreg.dec.sync.aligned.u32";

void compute_elect(WarpRendezvous& w) {
  const unsigned leader = static_cast<unsigned>(__builtin_ctz(w.mask));
  for (unsigned lane = 0; lane < 32; ++lane)
    if (w.mask >> lane & 1u) *static_cast<unsigned*>(w.out[lane]) = leader;
}

// A setmaxnreg some threads of a warpgroup wait in.
struct WarpgroupCall {
  const char* op = nullptr;  // null: none in progress
  unsigned registers = 0;
  Site site{};
  unsigned arrived[4] = {};  // per warp of the warpgroup: lanes arrived
  unsigned count = 0;        // the warpgroup's register count once set (0: the launch's)
};

thread_local WarpgroupCall warpgroups[kWarpgroups];

void check_register_count(const char* op, unsigned registers, Site site) {
  if (registers < 24 || registers > 256 || registers % 8 != 0) {
    fail(site, "%s %u: the register count must be in [24, 256] and a multiple of 8", op, registers);
  }
}

void check_whole_warpgroup(const BlockRun& block, const char* op, unsigned group, Site site) {
  if (block.thread_count < 128 * (group + 1)) {
    fail(site, "%s in warpgroup %u (warps %u-%u), but the block has only %u threads: every warp of a "
               "warpgroup must execute it", op, group, 4 * group, 4 * group + 3, block.thread_count);
  }
}

bool all_arrived(const BlockRun& block, const WarpgroupCall& call, unsigned group) {
  for (unsigned k = 0; k < 4; ++k)
    if (call.arrived[k] != block.live_lanes[4 * group + k]) return false;
  return true;
}

void finish(BlockRun& block, WarpgroupCall& call, unsigned group, Site site) {
  const bool raise = call.op == kSetmaxnregInc;
  if (call.count != 0 && (raise ? call.registers < call.count : call.registers > call.count)) {
    fail(site, "%s %u in warpgroup %u, whose register count is %u: .inc must not lower it, .dec must not raise it",
         call.op, call.registers, group, call.count);
  }
  for (unsigned k = 0; k < 4; ++k) {
    for (unsigned lanes = call.arrived[k]; lanes; lanes &= lanes - 1) {
      Fiber& fiber = block.fibers[(4 * group + k) * 32 + static_cast<unsigned>(__builtin_ctz(lanes))];
      if (&fiber == current_fiber) continue;
      fiber.state = FiberState::runnable;
      fiber.blocked_in = nullptr;
    }
  }
  const unsigned registers = call.registers;
  call = WarpgroupCall{};
  call.count = registers;
  block.idle_yields = 0;
}

void setmaxnreg(const char* op, unsigned registers, Site site) {
  check_register_count(op, registers, site);
  Fiber& self = *current_fiber;
  BlockRun& block = *self.block;
  const unsigned group = self.coords.warp / 4;
  check_whole_warpgroup(block, op, group, site);
  WarpgroupCall& call = warpgroups[group];
  if (call.op == nullptr) {
    call.op = op;
    call.registers = registers;
    call.site = site;
  } else if (call.op != op || call.registers != registers || call.site.line != site.line) {
    fail(site, "%s %u while other threads of warpgroup %u wait in %s %u at %s: every warp of a warpgroup must "
               "execute the same setmaxnreg", op, registers, group, call.op, call.registers,
         format_site(call.site).c_str());
  }
  call.arrived[self.coords.warp % 4] |= 1u << self.coords.lane;
  if (all_arrived(block, call, group)) {
    finish(block, call, group, site);
    return;
  }
  block_current(op, site);
}

}  // namespace

unsigned elect_sync(unsigned mask, Site site) {
  unsigned leader = 0;
  warp_collective(kElect, mask, nullptr, &leader, &compute_elect, site);
  return leader;
}

void setmaxnreg_inc(unsigned registers, Site site) { setmaxnreg(kSetmaxnregInc, registers, site); }
void setmaxnreg_dec(unsigned registers, Site site) { setmaxnreg(kSetmaxnregDec, registers, site); }

void fence_proxy_async(Site) {
  count_proxy_fence();
  proxy_fence_ran();
}

void warpgroup_control_block_start() {
  for (WarpgroupCall& call : warpgroups) call = WarpgroupCall{};
}

std::string describe_warpgroup_waits(const BlockRun& block) {
  std::string text;
  for (unsigned group = 0; group < kWarpgroups; ++group) {
    const WarpgroupCall& call = warpgroups[group];
    if (call.op == nullptr) continue;
    std::vector<unsigned> waiting, missing;
    for (unsigned k = 0; k < 4; ++k) {
      const unsigned warp = 4 * group + k;
      for (unsigned lane = 0; lane < 32 && warp * 32 + lane < block.thread_count; ++lane) {
        if (call.arrived[k] >> lane & 1u) {
          waiting.push_back(warp * 32 + lane);
        } else {
          missing.push_back(warp * 32 + lane);  // still running elsewhere, or exited
        }
      }
    }
    text += " Threads " + format_threads(waiting) + " wait in " + call.op + " " + std::to_string(call.registers) +
            " at " + format_site(call.site) + " for threads " + format_threads(missing) + " of warpgroup " +
            std::to_string(group) + ".";
  }
  return text;
}

}  // namespace fagen_emu
