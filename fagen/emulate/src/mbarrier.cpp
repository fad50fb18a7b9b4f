// mbarrier twins (fagen_emulate/mbarrier.h): the PTX ISA's mbarrier object
// ("Parallel Synchronization and Communication Instructions: mbarrier") as state
// beside shared memory, one table per block (one block runs per OS thread at a
// time, so the table is thread_local and cleared when a block starts).
//
// The ISA's rules this follows ("Contents of the mbarrier object", "Phase
// completion of the mbarrier object", "mbarrier.test_wait/mbarrier.try_wait"):
// - init sets the expected and pending arrival counts to `count` (1 to 2^20-1),
//   the tx-count to 0, the phase to 0;
// - expect-tx raises the tx-count, complete-tx lowers it; it stays within
//   [-(2^20-1), 2^20-1]; arrive-on lowers the pending count (arrive.expect_tx
//   is expect-tx, then arrive-on);
// - the current phase completes when the pending count and the tx-count are
//   both zero: the phase advances, the pending count is reloaded from the
//   expected count;
// - try_wait.parity(p) tests the phase of parity p among the current and the
//   immediately preceding phase: it has completed iff the current parity is not p.
#include "runtime_internal.h"

#include <algorithm>
#include <unordered_map>

namespace fagen_emu {
namespace {

constexpr uint32_t kMaxArrivalCount = (1u << 20) - 1;  // expected and pending arrival counts
constexpr int64_t kMaxTxCount = (int64_t{1} << 20) - 1;  // |tx-count|
const char kWaitOp[] = "mbarrier.try_wait.parity";

struct Waiter {
  unsigned thread;
  uint32_t parity;
  Site site;
};

struct Mbarrier {
  uint32_t expected = 0;
  uint32_t pending = 0;
  int64_t tx = 0;
  uint64_t phase = 0;          // the current phase's number: phases completed since init
  unsigned init_thread = 0;
  Site init_site{};
  bool fenced = false;         // the initialising thread ran fence.mbarrier_init since
  uint64_t fenced_at = 0;      // the block's completed __syncthreads at that fence
  std::vector<uint64_t> seen;  // per thread: the phase current when its last wait succeeded
  std::vector<Waiter> waiters;
};

thread_local std::unordered_map<uintptr_t, Mbarrier> barriers;

BlockRun& running_block() { return *current_fiber->block; }
unsigned me() { return current_fiber->coords.linear; }

std::string hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

// "the mbarrier at dynamic shared memory + 0x10", or at a static __shared__ offset.
std::string describe(uintptr_t address, const BlockRun& block) {
  const auto dynamic = reinterpret_cast<uintptr_t>(dynamic_shared_base());
  if (address - dynamic < kMaxDynamicSharedBytes) {
    return "the mbarrier at dynamic shared memory + " + hex(address - dynamic);
  }
  const StaticShared statics = static_shared_of(block.launch->entry.kernel);
  const auto base = reinterpret_cast<uintptr_t>(statics.data);
  if (statics.data && address - base < statics.size) {
    return "the mbarrier at static __shared__ + " + hex(address - base);
  }
  return "the mbarrier at " + hex(address);
}

// The barrier at `bar` as the running thread's fault messages name it.
std::string named(const void* bar) { return describe(reinterpret_cast<uintptr_t>(bar), running_block()); }

std::string state_of(const Mbarrier& b) {
  return "phase " + std::to_string(b.phase) + " (parity " + std::to_string(b.phase & 1) + "), " +
         std::to_string(b.pending) + " of " + std::to_string(b.expected) + " arrivals pending, tx-count " +
         std::to_string(b.tx);
}

void check_shared_object(uintptr_t address, const char* op, Site site) {
  if (address % 8 != 0) fail(site, "%s on %s: an mbarrier must be 8-byte aligned", op, hex(address).c_str());
  const auto dynamic = reinterpret_cast<uintptr_t>(dynamic_shared_base());
  const StaticShared statics = static_shared_of(running_block().launch->entry.kernel);
  const auto base = reinterpret_cast<uintptr_t>(statics.data);
  const bool in_static = statics.data && address - base + 8 <= statics.size;
  if (!in_static && address - dynamic >= kMaxDynamicSharedBytes) {
    fail(site, "%s on %s, which is not shared memory: an mbarrier lives in shared memory", op,
         hex(address).c_str());
  }
  if (!in_static) check_dynamic_shared_range(reinterpret_cast<void*>(address), 8, op, site);
}

// The barrier at `bar` for a use by the running thread: initialised, and its init visible.
Mbarrier& use(void* bar, const char* op, Site site) {
  const auto address = reinterpret_cast<uintptr_t>(bar);
  const auto found = barriers.find(address);
  if (found == barriers.end()) {
    check_shared_object(address, op, site);
    fail(site, "%s on %s, which was never initialised (no mbarrier.init at this address in this block): "
               "uninitialised memory used as an mbarrier", op, named(bar).c_str());
  }
  Mbarrier& b = found->second;
  const BlockRun& block = running_block();
  if (me() != b.init_thread && !(b.fenced && block.barriers_completed > b.fenced_at)) {
    fail(site, "%s on %s, which thread %u initialised at %s, before its init is visible to this thread (%s): "
               "the initialising thread must run fence.mbarrier_init, then a __syncthreads, before other threads "
               "use the barrier", op, named(bar).c_str(), b.init_thread, format_site(b.init_site).c_str(),
         b.fenced ? "no __syncthreads since the fence" : "no fence.mbarrier_init since the init");
  }
  return b;
}

// The phase waits for transaction bytes alone while a thread blocks on it: the moment the TMA
// loads in flight on it must land (tma.cpp), or the waiter would wait forever.
bool waits_for_bytes_only(const Mbarrier& b) { return b.pending == 0 && b.tx != 0 && !b.waiters.empty(); }

// Completes the current phase if nothing is pending: releases its waiters and,
// under the reordering schedules, lets the scheduler choose who runs next.
void complete_if_done(const void* bar, Mbarrier& b) {
  if (b.pending != 0 || b.tx != 0) return;
  b.phase += 1;
  b.pending = b.expected;
  mbarrier_phase_completed(bar);
  BlockRun& block = running_block();
  block.idle_yields = 0;
  for (const Waiter& waiter : b.waiters) {
    Fiber& fiber = block.fibers[waiter.thread];
    fiber.state = FiberState::runnable;
    fiber.blocked_in = nullptr;
    b.seen[waiter.thread] = b.phase;
    mbarrier_acquired(bar, waiter.thread);
  }
  const bool released = !b.waiters.empty();
  b.waiters.clear();
  if (released) reschedule_after_release();
}

void add_tx(void* bar, Mbarrier& b, int64_t delta, const char* op, Site site) {
  const int64_t tx = b.tx + delta;
  if (tx > kMaxTxCount || tx < -kMaxTxCount) {
    fail(site, "%s of %lld bytes on %s (%s): the tx-count would be %lld, outside the ISA's range "
               "[-(2^20-1), 2^20-1]: tx-count %s", op, static_cast<long long>(delta < 0 ? -delta : delta),
         named(bar).c_str(), state_of(b).c_str(), static_cast<long long>(tx),
         tx > 0 ? "overflow" : "underflow");
  }
  b.tx = tx;
}

uint64_t arrive_on(void* bar, Mbarrier& b, const char* op, Site site) {
  if (b.pending == 0) {
    fail(site, "%s on %s (%s): every expected arrival of this phase has been made (the phase waits for its "
               "tx-count): an arrival beyond the expected count", op,
         named(bar).c_str(), state_of(b).c_str());
  }
  const uint64_t token = b.phase;
  mbarrier_released(bar);
  b.pending -= 1;
  if (waits_for_bytes_only(b)) tma_land_loads(bar);  // the loads in flight land, then the phase may complete
  complete_if_done(bar, b);
  return token;
}

// The ABA rule: a thread's consecutive waits on one barrier may be at most one
// phase apart, or the parity it names no longer says which phase it means.
void check_phase_distance(void* bar, const Mbarrier& b, uint32_t parity, Site site) {
  const uint64_t last = b.seen[me()];
  if (b.phase < last + 2) return;
  fail(site, "%s(%u) on %s (%s): the barrier completed %llu phases since this thread's last wait on it "
             "(phase %llu then), so parity %u no longer names one phase (the ABA problem): the wait would %s",
       kWaitOp, parity, named(bar).c_str(), state_of(b).c_str(),
       static_cast<unsigned long long>(b.phase - last), static_cast<unsigned long long>(last), parity,
       (b.phase & 1) != parity ? "succeed on an older phase than the one meant"
                                : "block for a phase after the one meant");
}

bool phase_done(const Mbarrier& b, uint32_t parity) { return (b.phase & 1) != parity; }

// A thread waits on the phase of `parity`. If no arrival is pending, only transaction bytes are
// missing: the TMA loads in flight on the barrier land now, the latest a kernel can observe them.
Mbarrier& waitable(void* bar, uint32_t parity, Site site) {
  if (parity > 1) fail(site, "%s(%u): the phase parity must be 0 or 1", kWaitOp, parity);
  Mbarrier& b = use(bar, kWaitOp, site);
  check_phase_distance(bar, b, parity, site);
  if (!phase_done(b, parity) && b.pending == 0) tma_land_loads(bar);
  return b;
}

}  // namespace

// -- the twins ---------------------------------------------------------------------------

void mbarrier_init(void* bar, uint32_t expected_count, Site site) {
  const auto address = reinterpret_cast<uintptr_t>(bar);
  check_shared_object(address, "mbarrier.init", site);
  if (expected_count < 1 || expected_count > kMaxArrivalCount) {
    fail(site, "mbarrier.init on %s with count %u: the expected arrival count must be in [1, 2^20-1]",
         named(bar).c_str(), expected_count);
  }
  Mbarrier& b = barriers[address];
  if (!b.waiters.empty()) {
    fail(site, "mbarrier.init on %s while thread %u waits on it at %s", named(bar).c_str(),
         b.waiters.front().thread, format_site(b.waiters.front().site).c_str());
  }
  b = Mbarrier{};
  b.expected = b.pending = expected_count;
  b.init_thread = me();
  b.init_site = site;
  b.seen.assign(running_block().thread_count, 0);
}

void mbarrier_init_fence(Site) {
  const unsigned thread = me();
  const uint64_t barriers_completed = running_block().barriers_completed;
  for (auto& entry : barriers) {
    Mbarrier& b = entry.second;
    if (b.init_thread == thread && !b.fenced) {
      b.fenced = true;
      b.fenced_at = barriers_completed;
    }
  }
}

uint64_t mbarrier_arrive(void* bar, Site site) {
  return arrive_on(bar, use(bar, "mbarrier.arrive", site), "mbarrier.arrive", site);
}

uint64_t mbarrier_arrive_expect_tx(void* bar, uint32_t tx_bytes, Site site) {
  const char op[] = "mbarrier.arrive.expect_tx";
  Mbarrier& b = use(bar, op, site);
  add_tx(bar, b, tx_bytes, op, site);
  return arrive_on(bar, b, op, site);
}

void mbarrier_expect_tx(void* bar, uint32_t tx_bytes, Site site) {
  Mbarrier& b = use(bar, "mbarrier.expect_tx", site);
  add_tx(bar, b, tx_bytes, "mbarrier.expect_tx", site);
  complete_if_done(bar, b);  // a tx-count that complete-tx drove negative may come back to zero here
}

void mbarrier_complete_tx(void* bar, uint32_t tx_bytes, Site site) {
  Mbarrier& b = use(bar, "mbarrier.complete_tx", site);
  mbarrier_released(bar);
  add_tx(bar, b, -static_cast<int64_t>(tx_bytes), "mbarrier.complete_tx", site);
  complete_if_done(bar, b);
}

bool mbarrier_try_wait_parity(void* bar, uint32_t parity, Site site) {
  Mbarrier* b = &waitable(bar, parity, site);
  if (!phase_done(*b, parity)) {
    yield_to_block();  // the try's time limit: others run, and a spin that never ends is a livelock
    b = &use(bar, kWaitOp, site);
    if (!phase_done(*b, parity)) return false;
  }
  b->seen[me()] = b->phase;
  mbarrier_acquired(bar, me());
  return true;
}

void mbarrier_wait_parity(void* bar, uint32_t parity, Site site) {
  Mbarrier& b = waitable(bar, parity, site);
  if (phase_done(b, parity)) {
    b.seen[me()] = b.phase;
    mbarrier_acquired(bar, me());
    return;
  }
  b.waiters.push_back(Waiter{me(), parity, site});
  block_current(kWaitOp, site);  // released (and `seen` set) when the phase completes
}

bool mbarrier_waits_for_tx_only(void* bar) {
  const auto found = barriers.find(reinterpret_cast<uintptr_t>(bar));
  if (found == barriers.end()) return false;
  return waits_for_bytes_only(found->second);
}

// -- the block's lifecycle ---------------------------------------------------------------

void mbarrier_block_start() { barriers.clear(); }

std::string describe_mbarrier_waits(const BlockRun& block) {
  std::vector<std::pair<uintptr_t, const Mbarrier*>> waited;
  for (const auto& entry : barriers)
    if (!entry.second.waiters.empty()) waited.emplace_back(entry.first, &entry.second);
  std::sort(waited.begin(), waited.end());
  std::string text;
  for (const auto& [address, b] : waited) {
    std::vector<unsigned> threads;
    for (const Waiter& w : b->waiters) threads.push_back(w.thread);
    std::sort(threads.begin(), threads.end());
    const Waiter& first = b->waiters.front();
    text += " Threads " + format_threads(threads) + " wait in " + kWaitOp + " at " + format_site(first.site) +
            " for parity " + std::to_string(first.parity) + " of " + describe(address, block) + " (" + state_of(*b) +
            "), a phase that cannot complete.";
  }
  return text;
}

}  // namespace fagen_emu
