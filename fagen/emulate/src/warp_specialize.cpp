// elect.sync, setmaxnreg and fence.proxy.async twins (fagen_emulate/warp_specialize.h).
//
// elect.sync (PTX ISA, "Parallel Synchronization and Communication Instructions:
// elect.sync"): warp-collective over `membermask`; one leader is elected, the same
// one for the same mask every time. Which lane the ISA leaves open; the twin elects
// the lowest lane of the mask (a kernel must not depend on it; the GPU check is to
// compare with the hardware's choice).
//
// setmaxnreg (PTX ISA, "Miscellaneous Instructions: setmaxnreg"):
// .sync.aligned: every warp of the warpgroup (four consecutive warps, warp / 4)
// executes the same setmaxnreg; the register count is an immediate in [24, 256]
// and a multiple of 8; .inc raises the per-thread maximum to it, .dec lowers it.
// The twin is the warpgroup rendezvous of wgmma (warpgroup.cpp: all 128 threads
// at one op and call site), and checks those rules and, once the warpgroup has a
// count from an earlier setmaxnreg, that .inc does not lower it and .dec does not
// raise it. Not checked: the ISA's demand that
// the warpgroup's warps synchronise explicitly between two setmaxnreg (the
// rendezvous itself orders them), and the CTA's register pool that .inc waits on.
//
// fence.proxy.async: orders the generic proxy's shared-memory accesses against
// the async proxy's (TMA, wgmma operands). The twin records the fence (counted
// per launch); racecheck orders async-proxy reads after generic writes by it.
#include "runtime_internal.h"

namespace fagen_emu {
namespace {

const char kElect[] = "elect.sync";
constexpr unsigned kRegisterFile = 65536;  // 32-bit registers per SM on sm_90
const char kSetmaxnregInc[] = "setmaxnreg.inc.sync.aligned.u32";
const char kSetmaxnregDec[] = "setmaxnreg.dec.sync.aligned.u32";

void compute_elect(WarpRendezvous& w) {
  const unsigned leader = static_cast<unsigned>(__builtin_ctz(w.mask));
  for (unsigned lane = 0; lane < 32; ++lane)
    if (w.mask >> lane & 1u) *static_cast<unsigned*>(w.out[lane]) = leader;
}

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

// Once every warpgroup of the block has set its count, they must fit the SM's register file
// together (setmaxnreg.inc waits for registers the others release: more than the file holds
// would wait forever on the GPU). A warpgroup yet to set one holds the launch's count, which the
// emulator does not know, so the check waits for all of them.
void check_register_file(const BlockRun& block, Site site) {
  unsigned total = 0;
  std::string counts;
  for (unsigned group = 0; group < block.thread_count / 128; ++group) {
    const unsigned registers = block.warpgroups[group].registers;
    if (registers == 0) return;
    total += 128 * registers;
    counts += (counts.empty() ? "" : ", ") + std::to_string(registers);
  }
  if (total > kRegisterFile) {
    fail(site, "the warpgroups' setmaxnreg counts (%s) need %u registers, more than the SM's register file of %u",
         counts.c_str(), total, kRegisterFile);
  }
}

// The warpgroup's 128 threads met at one setmaxnreg (warpgroup.cpp's rendezvous: the same op at
// the same call site); `in[t]` is thread t's register count.
void compute_setmaxnreg(WarpgroupRendezvous& w) {
  const unsigned registers = *static_cast<const unsigned*>(w.in[0]);
  for (unsigned t = 1; t < 128; ++t) {
    const unsigned other = *static_cast<const unsigned*>(w.in[t]);
    if (other != registers) {
      fail(w.site, "%s: threads %u and %u of warpgroup %u name %u and %u registers: every warp of a warpgroup must "
                   "execute the same setmaxnreg", w.op, 128 * w.group, 128 * w.group + t, w.group, registers, other);
    }
  }
  WarpgroupState& state = current_fiber->block->warpgroups[w.group];
  const bool raise = w.op == kSetmaxnregInc;
  if (state.registers != 0 && (raise ? registers < state.registers : registers > state.registers)) {
    fail(w.site, "%s %u in warpgroup %u, whose register count is %u: .inc must not lower it, .dec must not raise it",
         w.op, registers, w.group, state.registers);
  }
  state.registers = registers;
  check_register_file(*current_fiber->block, w.site);
}

void setmaxnreg(const char* op, unsigned registers, Site site) {
  check_register_count(op, registers, site);
  check_whole_warpgroup(*current_fiber->block, op, current_fiber->coords.warp / 4, site);
  warpgroup_collective(op, &registers, nullptr, &compute_setmaxnreg, site);
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

}  // namespace fagen_emu
