// Racecheck: hazards between the threads of a block in shared memory, and
// between blocks in global memory, seen through an instrumented kernel module
// (every plain load and store, instrument.cpp) and the runtime's own accesses
// (ldmatrix rows, cp.async and TMA copies).
//
// Shared memory: two accesses to one byte, at least one a write, by different
// threads, are a hazard unless the first happens before the second
// (happens_before.h: __syncthreads, __syncwarp, named barriers, mbarrier
// phases; warp-collective ops order lanes only under the lenient switch, as on
// Volta and later they do not order memory). Shadow state per byte (the
// launch's dynamic buffer and the module's static __shared__ arrays), as
// FastTrack keeps it: the last write as (thread, clock), the reads since as
// one (thread, clock) while each happens before the next, and as a read set
// once threads read concurrently.
//
// Copies:
// - cp.async: the destination is pending from issue until the issuing thread's
//   wait lands it; any access to pending bytes is a hazard, and the issue is a
//   write (a copy into bytes another thread reads unordered is a write-after-read),
//   as is the landing.
// - TMA load: the issue is a write by the issuing thread, the bytes are pending
//   until they land, and they land as a write of the mbarrier's async agent,
//   ordered (through the phase) before the threads that wait on it.
// - TMA store / bulk reduction: the async proxy reads the source between issue
//   and the bulk wait that retires it. At issue every write to the source must
//   happen before the issue and be followed, in its writer, by fence.proxy.async
//   that happens before the issue; until retired, a write to the source is a
//   hazard; the retirement is a read by the issuing thread.
//
// Global memory: every plain store to a tensor argument records the block
// that made it (and its epoch: the block's semaphore arrives before it); a
// second block storing to the same byte without an atomic is a hazard (two
// blocks of one launch run in no defined order) unless semaphores order them:
// an arrive releases the block's clock (per block, FastTrack's scheme at block
// granularity) into the semaphore, a wait that returns acquires it.
#include "happens_before.h"
#include "race_report.h"

#include <algorithm>
#include <cstring>

namespace fagen_emu {

enum PendingKind : uint8_t { kNotPending = 0, kCpAsyncPending = 1, kTmaLoadPending = 2 };

struct ShadowCell {
  uint32_t write_generation;  // 0: never written
  Clock write_clock;
  SiteCode write_site;
  uint16_t writer;            // a thread, or an async agent (>= the block's threads)
  uint8_t pending;            // a PendingKind: a copy into this byte has not landed
  uint8_t async_reads;        // bulk stores / reductions reading this byte, not yet retired
  uint32_t read_generation;   // 0: no read in this generation
  Clock read_clock;
  SiteCode read_site;         // the read set's index when reader == kReadSet
  uint16_t reader;
  uint16_t issuer;            // of the TMA load whose agent wrote the byte
};

// What a pending byte waits for (apart from the hot cell: touched only when pending).
struct PendingCell {
  uint32_t copy_generation;   // the block's generation at issue: stale from another block
  SiteCode copy_site;
  uint16_t copy_owner;
  uint32_t read_generation;   // of the latest async read
  SiteCode read_site;
  uint16_t read_owner;
};

struct ReadEntry {
  uint16_t thread;
  Clock clock;
  SiteCode site;
};

struct InFlightLoad {
  const unsigned char* destination;
  std::size_t bytes;
  const void* bar;
  unsigned issuer;
  SiteCode site;
  std::vector<Clock> issued;
};

// This OS thread's shadow of shared memory and the running block's clocks.
struct RaceShadow {
  std::vector<ShadowCell> cells;    // dynamic buffer first, then the static arrays
  std::vector<PendingCell> pending;
  unsigned char* dynamic_base = nullptr;
  unsigned char* static_base = nullptr;
  std::size_t static_size = 0;
  HappensBefore clocks;
  std::vector<std::vector<ReadEntry>> read_sets;  // valid in the current generation
  std::size_t read_sets_used = 0;
  std::vector<uint32_t> free_read_sets;
  std::vector<InFlightLoad> loads;
  const void* landing_bar = nullptr;  // a TMA load's complete_tx is the agent's, not the thread's
  BlockRun* block = nullptr;
  BlockClock global_clock;    // global memory: the other blocks' epochs this block acquired
  uint32_t global_epoch = 0;  // its semaphore arrives so far: the epoch of its global writes
};

namespace {

constexpr uint16_t kReadSet = 0xFFFF;

// This OS thread's shadow. A plain pointer (not a thread_local object with a
// constructor): every access to it is then one cheap TLS read, no init wrapper.
__thread RaceShadow* shadow_of_thread = nullptr;

inline RaceShadow& shadow() { return *shadow_of_thread; }

ShadowCell* cell_of(const unsigned char* p) {
  RaceShadow& s = shadow();
  if (p >= s.dynamic_base && p < s.dynamic_base + kMaxDynamicSharedBytes)
    return &s.cells[static_cast<std::size_t>(p - s.dynamic_base)];
  if (s.static_size && p >= s.static_base && p < s.static_base + s.static_size)
    return &s.cells[kMaxDynamicSharedBytes + static_cast<std::size_t>(p - s.static_base)];
  return nullptr;
}

PendingCell& pending_of(const ShadowCell& c) {
  return shadow().pending[static_cast<std::size_t>(&c - shadow().cells.data())];
}

const unsigned char* address_of(const ShadowCell& c) {
  const std::size_t index = static_cast<std::size_t>(&c - shadow().cells.data());
  return index < kMaxDynamicSharedBytes ? shadow().dynamic_base + index
                                        : shadow().static_base + (index - kMaxDynamicSharedBytes);
}

RaceContext context() {
  return RaceContext{shadow().block, shadow().dynamic_base, shadow().static_base, shadow().clocks.threads()};
}

// -- read sets ----------------------------------------------------------------------------

uint32_t new_read_set() {
  RaceShadow& s = shadow();
  uint32_t index;
  if (!s.free_read_sets.empty()) {
    index = s.free_read_sets.back();
    s.free_read_sets.pop_back();
  } else {
    if (s.read_sets_used == s.read_sets.size()) s.read_sets.emplace_back();
    index = static_cast<uint32_t>(s.read_sets_used++);
  }
  s.read_sets[index].clear();
  return index;
}

// A new generation: every read set is of an older one (all ordered), so all are free.
void drop_read_sets() {
  shadow().read_sets_used = 0;
  shadow().free_read_sets.clear();
}

void clear_reads(ShadowCell& c) {
  if (c.read_generation == shadow().clocks.generation() && c.reader == kReadSet)
    shadow().free_read_sets.push_back(c.read_site);
  c.read_generation = 0;
}

// -- checks ---------------------------------------------------------------------------------

Access access_of(const ShadowCell& c, const ThreadRef& t, bool write, SiteCode site) {
  return Access{address_of(c), t.linear, write, site};
}

void check_copy_pending(ShadowCell& c, const Access& now) {
  const PendingCell& p = pending_of(c);
  if (p.copy_generation < shadow().clocks.first_generation()) {
    c.pending = kNotPending;  // left by an earlier block
    return;
  }
  report_pending_copy(context(), now, p.copy_owner, p.copy_site, c.pending == kTmaLoadPending);
}

bool async_reads_live(ShadowCell& c) {
  if (pending_of(c).read_generation >= shadow().clocks.first_generation()) return true;
  c.async_reads = 0;  // left by an earlier block
  return false;
}

[[noreturn]] void report_last_write(const ShadowCell& c, const Access& now) {
  report_unordered(context(), now, Prior{c.writer, c.issuer, true, c.write_site});
}

// The last write happens before `now` (a read, or a write); the Access is built only to report.
inline void check_last_write(const ShadowCell& c, const ThreadRef& t, bool write, SiteCode site) {
  if (shadow().clocks.before(c.writer, c.write_generation, c.write_clock, t.linear)) return;
  report_last_write(c, access_of(c, t, write, site));
}

inline void check_read(ShadowCell& c, const ThreadRef& t, SiteCode site) {
  if (c.pending) check_copy_pending(c, access_of(c, t, false, site));
  check_last_write(c, t, false, site);
}

void record_read(ShadowCell& c, const ThreadRef& t, SiteCode site) {
  RaceShadow& s = shadow();
  const HappensBefore& hb = s.clocks;
  const uint32_t generation = hb.generation();
  const Clock now = hb.now(t.linear);
  if (c.read_generation == generation && c.reader == kReadSet) {
    std::vector<ReadEntry>& set = s.read_sets[c.read_site];
    for (ReadEntry& e : set) {
      if (e.thread == t.linear) {
        e.clock = now;
        e.site = site;
        return;
      }
    }
    set.push_back(ReadEntry{t.linear, now, site});
    return;
  }
  // One reader: replace it when it happens before this read (a later write ordered
  // after this one is then ordered after it too); else the two read concurrently.
  if (c.read_generation == generation && !hb.before(c.reader, generation, c.read_clock, t.linear)) {
    const uint32_t index = new_read_set();
    s.read_sets[index].push_back(ReadEntry{c.reader, c.read_clock, c.read_site});
    s.read_sets[index].push_back(ReadEntry{t.linear, now, site});
    c.reader = kReadSet;
    c.read_site = index;
    return;
  }
  c.read_generation = generation;
  c.reader = t.linear;
  c.read_clock = now;
  c.read_site = site;
}

void check_reads_before_write(const ShadowCell& c, const ThreadRef& t, SiteCode site) {
  const HappensBefore& hb = shadow().clocks;
  const uint32_t generation = hb.generation();
  if (c.read_generation != generation) return;
  if (c.reader != kReadSet) {
    if (!hb.before(c.reader, generation, c.read_clock, t.linear))
      report_unordered(context(), access_of(c, t, true, site), Prior{c.reader, 0, false, c.read_site});
    return;
  }
  for (const ReadEntry& e : shadow().read_sets[c.read_site]) {
    if (!hb.before(e.thread, generation, e.clock, t.linear))
      report_unordered(context(), access_of(c, t, true, site), Prior{e.thread, 0, false, e.site});
  }
}

// `copy_landing`: a cp.async landing, whose own pending state it ends.
void check_write(ShadowCell& c, const ThreadRef& t, SiteCode site, bool copy_landing) {
  if (c.pending && !copy_landing) check_copy_pending(c, access_of(c, t, true, site));
  if (c.async_reads && async_reads_live(c)) {
    const PendingCell& p = pending_of(c);
    report_async_read_in_flight(context(), access_of(c, t, true, site), p.read_owner, p.read_site);
  }
  check_last_write(c, t, true, site);
  check_reads_before_write(c, t, site);
}

void record_write(ShadowCell& c, uint16_t writer, Clock clock, SiteCode site) {
  clear_reads(c);
  c.write_generation = shadow().clocks.generation();
  c.write_clock = clock;
  c.writer = writer;
  c.write_site = site;
}

void write_byte(ShadowCell& c, const ThreadRef& t, SiteCode site) {
  check_write(c, t, site, false);
  record_write(c, t.linear, shadow().clocks.now(t.linear), site);
}

// The cells of [p, p + bytes) in shared memory, or null (not shared memory).
ShadowCell* cells_of(const void* address, std::size_t& bytes) {
  const auto* p = static_cast<const unsigned char*>(address);
  ShadowCell* c = cell_of(p);
  if (!c) return nullptr;
  ShadowCell* last = cell_of(p + bytes - 1);  // an access never straddles the two regions
  if (!last || last < c) bytes = 1;
  return c;
}

}  // namespace

// -- block and sync events ---------------------------------------------------------------

void race_block_start(BlockRun& block) {
  if (!shadow_of_thread) shadow_of_thread = new RaceShadow();  // kept for the thread's life
  RaceShadow& s = shadow();
  if (s.cells.empty()) {
    s.dynamic_base = dynamic_shared_base();
    s.cells.resize(kMaxDynamicSharedBytes);
  }
  const StaticShared statics = static_shared_of(block.launch->entry.kernel);
  s.static_base = statics.data;
  s.static_size = statics.size;
  if (s.cells.size() < kMaxDynamicSharedBytes + statics.size) s.cells.resize(kMaxDynamicSharedBytes + statics.size);
  if (s.pending.size() < s.cells.size()) s.pending.resize(s.cells.size());
  s.clocks.block_start(block.thread_count);
  drop_read_sets();
  s.loads.clear();
  s.landing_bar = nullptr;
  s.block = &block;
  s.global_clock.clear();
  s.global_epoch = 0;
}

void race_barrier() {
  shadow().clocks.block_barrier();
  drop_read_sets();
}

void race_warp_sync(unsigned warp, unsigned mask) { shadow().clocks.warp_sync(warp, mask); }

void race_mbarrier_release(const void* bar, unsigned thread) {
  if (shadow().landing_bar == bar) {  // the landing TMA load's complete_tx: race_tma_load_landed released it
    shadow().landing_bar = nullptr;
    return;
  }
  shadow().clocks.mbarrier_release(bar, thread);
}

void race_mbarrier_phase_completed(const void* bar) { shadow().clocks.mbarrier_phase_completed(bar); }
void race_mbarrier_acquire(const void* bar, unsigned thread) { shadow().clocks.mbarrier_acquire(bar, thread); }
void race_named_release(unsigned id, unsigned thread) { shadow().clocks.named_release(id, thread); }

void race_named_completed(unsigned id, const unsigned* waiting) {
  shadow().clocks.named_completed(id, waiting, shadow().block->warp_count);
}

void race_proxy_fence(unsigned thread) { shadow().clocks.proxy_fence(thread); }

// -- accesses ---------------------------------------------------------------------------

bool race_shared_access(const ThreadRef& t, const void* address, std::size_t bytes, bool write, SiteCode site) {
  ShadowCell* c = cells_of(address, bytes);
  if (!c) return false;
  for (std::size_t i = 0; i < bytes; ++i, ++c) {
    if (write) {
      write_byte(*c, t, site);
    } else {
      check_read(*c, t, site);
      record_read(*c, t, site);
    }
  }
  return true;
}

void race_cp_async_issued(const ThreadRef& t, const void* destination, SiteCode site) {
  const auto* p = static_cast<const unsigned char*>(destination);
  for (std::size_t i = 0; i < 16; ++i) {
    ShadowCell* c = cell_of(p + i);
    if (!c) return;
    write_byte(*c, t, site);  // also: a copy into bytes still pending from another
    PendingCell& pending = pending_of(*c);
    c->pending = kCpAsyncPending;
    pending.copy_owner = t.linear;
    pending.copy_generation = shadow().clocks.generation();
    pending.copy_site = site;
  }
}

void race_cp_async_landed(const ThreadRef& t, const void* destination, SiteCode site) {
  const auto* p = static_cast<const unsigned char*>(destination);
  for (std::size_t i = 0; i < 16; ++i) {
    ShadowCell* c = cell_of(p + i);
    if (!c) return;
    c->pending = kNotPending;
    check_write(*c, t, site, true);
    record_write(*c, t.linear, shadow().clocks.now(t.linear), site);
  }
}

void race_tma_load_issued(const ThreadRef& t, void* destination, std::size_t bytes, const void* bar, SiteCode site) {
  ShadowCell* c = cells_of(destination, bytes);
  if (!c) return;
  for (std::size_t i = 0; i < bytes; ++i, ++c) {
    write_byte(*c, t, site);
    PendingCell& pending = pending_of(*c);
    c->pending = kTmaLoadPending;
    pending.copy_owner = t.linear;
    pending.copy_generation = shadow().clocks.generation();
    pending.copy_site = site;
  }
  shadow().loads.push_back(InFlightLoad{static_cast<const unsigned char*>(destination), bytes, bar, t.linear, site,
                                        shadow().clocks.issue_async(t.linear)});
}

void race_tma_load_landed(const void* destination, const void* bar) {
  RaceShadow& s = shadow();
  const auto found = std::find_if(s.loads.begin(), s.loads.end(), [&](const InFlightLoad& l) {
    return l.destination == destination && l.bar == bar;
  });
  if (found == s.loads.end()) return;
  Clock clock = 0;
  const unsigned agent = s.clocks.land_async(bar, found->issued, clock);
  std::size_t bytes = found->bytes;
  ShadowCell* c = cells_of(destination, bytes);
  for (std::size_t i = 0; c && i < bytes; ++i, ++c) {
    c->pending = kNotPending;
    record_write(*c, static_cast<uint16_t>(agent), clock, found->site);
    c->issuer = static_cast<uint16_t>(found->issuer);
  }
  s.loads.erase(found);
  s.landing_bar = bar;  // the complete_tx that follows is this landing's, released above
}

void race_async_read_issued(const ThreadRef& t, const void* source, std::size_t bytes, SiteCode site) {
  ShadowCell* c = cells_of(source, bytes);
  if (!c) return;
  const HappensBefore& hb = shadow().clocks;
  for (std::size_t i = 0; i < bytes; ++i, ++c) {
    Access now = access_of(*c, t, false, site);
    now.async_read = true;
    if (c->pending) check_copy_pending(*c, now);
    if (!hb.before(c->writer, c->write_generation, c->write_clock, t.linear)) report_last_write(*c, now);
    const bool generic_write = c->write_generation >= hb.first_generation() && c->writer < hb.threads();
    if (generic_write && !hb.fenced_before(c->writer, c->write_clock, t.linear))
      report_missing_proxy_fence(context(), now, c->writer, c->write_site);
    PendingCell& pending = pending_of(*c);
    if (c->async_reads && !async_reads_live(*c)) c->async_reads = 0;
    c->async_reads = static_cast<uint8_t>(std::min(c->async_reads + 1, 255));
    pending.read_owner = t.linear;
    pending.read_site = site;
    pending.read_generation = hb.generation();
  }
}

void race_async_read_retired(const ThreadRef& t, const void* source, std::size_t bytes, SiteCode site) {
  ShadowCell* c = cells_of(source, bytes);
  for (std::size_t i = 0; c && i < bytes; ++i, ++c) {
    if (c->async_reads) c->async_reads -= 1;
    record_read(*c, t, site);  // the async proxy's read, ordered before the retiring wait
  }
}

void race_global_write(const ThreadRef& t, int tensor, uintptr_t address, std::size_t bytes, SiteCode site) {
  RaceShadow& s = shadow();
  Instrumentation& inst = *s.block->launch->instrumentation;
  GlobalShadow* written = inst.written_by[static_cast<std::size_t>(tensor)].get();
  if (!written) return;
  const TensorRange& range = *inst.tensors[static_cast<std::size_t>(tensor)];
  const uint64_t me = ((s.block->linear_block + 1) << 10) | t.linear;
  for (std::size_t i = 0; i < bytes; ++i) {
    const uint64_t offset = address + i - range.begin;
    if (offset >= range.bytes) break;
    uint64_t seen = written->owner[offset].load(std::memory_order_relaxed);
    for (;;) {
      if (seen == me && written->epoch[offset].load(std::memory_order_relaxed) == s.global_epoch) break;
      // Ordered: the same block (its own barriers order it), or a block whose write this one
      // acquired through semaphores. Then this write is the byte's latest.
      const bool ordered = seen == 0 || (seen >> 10) == (me >> 10) || [&] {
        const auto found = s.global_clock.find((seen >> 10) - 1);
        return found != s.global_clock.end() &&
               found->second >= written->epoch[offset].load(std::memory_order_relaxed);
      }();
      if (!ordered) {
        report_global_write(context(), t, range, offset, site, seen,
                            written->site[offset].load(std::memory_order_relaxed));
      }
      if (written->owner[offset].compare_exchange_weak(seen, me, std::memory_order_relaxed)) {
        written->site[offset].store(site, std::memory_order_relaxed);
        written->epoch[offset].store(s.global_epoch, std::memory_order_relaxed);
        break;
      }
    }
  }
}

// A semaphore arrive: the block's global writes so far (and those it acquired) are released into
// the semaphore together with the increment, under one lock, so that a block that reads the new
// value acquires them. The semaphore's clock accumulates every arrive, an over-approximation that
// can only hide a hazard.
void race_semaphore_release(int* sem) {
  RaceShadow& s = shadow();
  Instrumentation& inst = *s.block->launch->instrumentation;
  std::lock_guard<std::mutex> lock(inst.semaphore_mutex);
  BlockClock& released = inst.semaphore_clocks[reinterpret_cast<uintptr_t>(sem)];
  for (const auto& [block, epoch] : s.global_clock) released[block] = std::max(released[block], epoch);
  uint32_t& mine = released[s.block->linear_block];
  mine = std::max(mine, s.global_epoch);
  __atomic_fetch_add(sem, 1, __ATOMIC_ACQ_REL);
  s.global_epoch += 1;
}

void race_semaphore_acquire(const int* sem) {
  RaceShadow& s = shadow();
  Instrumentation& inst = *s.block->launch->instrumentation;
  std::lock_guard<std::mutex> lock(inst.semaphore_mutex);
  const auto found = inst.semaphore_clocks.find(reinterpret_cast<uintptr_t>(sem));
  if (found == inst.semaphore_clocks.end()) return;
  for (const auto& [block, epoch] : found->second) {
    if (block == s.block->linear_block) continue;
    uint32_t& known = s.global_clock[block];
    known = std::max(known, epoch);
  }
}

}  // namespace fagen_emu
