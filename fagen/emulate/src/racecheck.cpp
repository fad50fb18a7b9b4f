// Racecheck: hazards between the threads of a block in shared memory, and
// between blocks in global memory, seen through an instrumented kernel module
// (every plain load and store, instrument.cpp) and the runtime's own accesses
// (ldmatrix rows, cp.async destinations).
//
// Shadow state per byte of shared memory (the launch's dynamic buffer and the
// module's static __shared__ arrays): the last write and the reads since, each
// stamped with the barrier epoch it happened in and the thread that made it.
// Epochs count completed __syncthreads and are unique per OS thread, so a
// stamp from an earlier block is simply an older epoch. Two accesses to one
// byte, at least one a write, by different threads, are a hazard when no
// __syncthreads separates them (same epoch) and, for two lanes of one warp,
// no __syncwarp covering both came between (warp-collective ops order lanes
// only under the lenient switch: on Volta and later they do not order memory).
//
// cp.async: the destination is pending from issue until the issuing thread's
// wait lands it; any access to pending bytes is a hazard, and the issue is a
// write (a copy into bytes another thread reads in the same epoch is a
// write-after-read), as is the landing.
//
// Global memory: every plain store to a tensor argument records the block
// that made it; a second block storing to the same byte without an atomic is
// a hazard (two blocks of one launch run in no defined order).
#include "runtime_internal.h"

#include <algorithm>
#include <cstring>

namespace fagen_emu {

struct ShadowCell {
  uint32_t write_epoch;   // 0: never written (epochs start at 1)
  uint32_t write_seq;     // the writer's warp sync sequence at the write
  SiteCode write_site;
  uint16_t writer;
  uint16_t reader;        // the first reader in read_epoch
  uint32_t read_epoch;
  uint32_t read_seq;      // the latest warp sync sequence among the readers
  SiteCode read_site;
  uint32_t reader_lanes;  // lanes of the first reader's warp that read in read_epoch
  uint32_t pending_epoch; // a cp.async destination, not landed (valid while >= the block's first epoch)
  SiteCode pending_site;
  SiteCode other_site;
  uint16_t pending_owner;
  uint16_t other_reader;       // the first reader in read_epoch outside the first reader's warp
  uint8_t other_warp_readers;  // whether there is one
  uint8_t pending;
};

// This OS thread's shadow of shared memory and the running block's warp syncs.
struct RaceShadow {
  std::vector<ShadowCell> cells;    // dynamic buffer first, then the static arrays
  unsigned char* dynamic_base = nullptr;
  unsigned char* static_base = nullptr;
  std::size_t static_size = 0;
  uint32_t epoch_counter = 0;
  uint32_t first_epoch = 0;         // of the running block
  uint32_t epoch = 0;
  unsigned warp_count = 0;
  uint32_t warp_seq[32] = {};
  std::vector<uint32_t> pair_sync;  // [warp][lane][lane]: seq of the last sync of both lanes
  BlockRun* block = nullptr;
};

namespace {

// This OS thread's shadow. A plain pointer (not a thread_local object with a
// constructor): every access to it is then one cheap TLS read, no init wrapper.
__thread RaceShadow* shadow_of_thread = nullptr;

inline RaceShadow& shadow() { return *shadow_of_thread; }

bool valid(uint32_t epoch) { return epoch >= shadow().first_epoch && epoch != 0; }

ShadowCell* cell_of(const unsigned char* p) {
  if (p >= shadow().dynamic_base && p < shadow().dynamic_base + kMaxDynamicSharedBytes)
    return &shadow().cells[static_cast<std::size_t>(p - shadow().dynamic_base)];
  if (shadow().static_size && p >= shadow().static_base && p < shadow().static_base + shadow().static_size)
    return &shadow().cells[kMaxDynamicSharedBytes + static_cast<std::size_t>(p - shadow().static_base)];
  return nullptr;
}

std::string describe_offset(const unsigned char* p) {
  if (p >= shadow().dynamic_base && p < shadow().dynamic_base + kMaxDynamicSharedBytes)
    return "dynamic shared memory byte " + std::to_string(p - shadow().dynamic_base);
  return "static __shared__ byte " + std::to_string(p - shadow().static_base);
}

// Whether lanes `a` (at sequence `seq`) and `b` of `warp` synchronised since.
bool warp_ordered(unsigned warp, unsigned a, unsigned b, uint32_t seq) {
  return shadow().pair_sync[(warp * 32 + a) * 32 + b] > seq;
}

ThreadRef ref_of(uint16_t linear) {
  return ThreadRef{linear, static_cast<uint8_t>(linear / 32), static_cast<uint8_t>(linear % 32)};
}

std::string describe_thread(const ThreadRef& t) {
  return "thread " + std::to_string(t.linear) + " (warp " + std::to_string(t.warp) + ", lane " +
         std::to_string(t.lane) + ")";
}

// Two accesses to one byte in one epoch: ordered only within a warp, by a sync.
bool ordered(uint16_t first, uint32_t first_seq, const ThreadRef& second) {
  const ThreadRef a = ref_of(first);
  return a.warp == second.warp && warp_ordered(a.warp, a.lane, second.lane, first_seq);
}

[[noreturn]] void report(const char* kind, const unsigned char* p, const ThreadRef& now, bool now_writes,
                         SiteCode now_site, uint16_t before, bool before_wrote, SiteCode before_site,
                         const char* why) {
  Instrumentation& inst = *shadow().block->launch->instrumentation;
  const BlockRun& block = *shadow().block;
  std::string message = std::string("racecheck: ") + kind + " hazard on " + describe_offset(p) + " in block (" +
                        std::to_string(block.block_idx.x) + "," + std::to_string(block.block_idx.y) + "," +
                        std::to_string(block.block_idx.z) + "): " + describe_thread(now) +
                        (now_writes ? " writes it at " : " reads it at ") + inst.describe_site(now_site) + ", " +
                        describe_thread(ref_of(before)) + (before_wrote ? " wrote it at " : " read it at ") +
                        inst.describe_site(before_site) + "; " + why;
  fail_race(message);
}

const char kNoBarrier[] = "no __syncthreads between them";
const char kNoSyncwarp[] = "lanes of one warp, and no __syncwarp between them";

const char* why_unordered(uint16_t before, const ThreadRef& now) {
  return ref_of(before).warp == now.warp ? kNoSyncwarp : kNoBarrier;
}

void check_pending(ShadowCell& c, const unsigned char* p, const ThreadRef& t, bool write, SiteCode site) {
  if (!c.pending || !valid(c.pending_epoch)) return;
  if (c.pending_owner == t.linear) {
    report(write ? "write-before-landing" : "read-before-landing", p, t, write, site, c.pending_owner, true,
           c.pending_site, "the cp.async into this byte has not landed: its thread's cp.async wait comes later");
  }
  report(write ? "write-after-write (cp.async in flight)" : "read-after-write (cp.async in flight)", p, t, write,
         site, c.pending_owner, true, c.pending_site,
         "the cp.async into this byte has not landed (its thread has not waited for it), whatever barriers "
         "came between");
}

void check_read(ShadowCell& c, const unsigned char* p, const ThreadRef& t, SiteCode site) {
  check_pending(c, p, t, false, site);
  if (valid(c.write_epoch) && c.write_epoch == shadow().epoch && c.writer != t.linear &&
      !ordered(c.writer, c.write_seq, t)) {
    report("read-after-write", p, t, false, site, c.writer, true, c.write_site, why_unordered(c.writer, t));
  }
}

void record_read(ShadowCell& c, const ThreadRef& t, SiteCode site) {
  const uint32_t seq = shadow().warp_seq[t.warp];
  if (!(valid(c.read_epoch) && c.read_epoch == shadow().epoch)) {
    c.read_epoch = shadow().epoch;
    c.reader = t.linear;
    c.read_seq = seq;
    c.read_site = site;
    c.reader_lanes = 1u << t.lane;
    c.other_warp_readers = 0;
    return;
  }
  if (t.warp == c.reader / 32) {
    c.reader_lanes |= 1u << t.lane;
    c.read_seq = std::max(c.read_seq, seq);
  } else if (!c.other_warp_readers) {
    c.other_warp_readers = 1;
    c.other_reader = t.linear;
    c.other_site = site;
  }
}

void check_write(ShadowCell& c, const unsigned char* p, const ThreadRef& t, SiteCode site, bool landing) {
  if (!landing) check_pending(c, p, t, true, site);
  if (valid(c.write_epoch) && c.write_epoch == shadow().epoch && c.writer != t.linear &&
      !ordered(c.writer, c.write_seq, t)) {
    report("write-after-write", p, t, true, site, c.writer, true, c.write_site, why_unordered(c.writer, t));
  }
  if (!(valid(c.read_epoch) && c.read_epoch == shadow().epoch)) return;
  const unsigned reader_warp = c.reader / 32u;
  if (reader_warp != t.warp) report("write-after-read", p, t, true, site, c.reader, false, c.read_site, kNoBarrier);
  if (c.other_warp_readers) {
    // Readers in two warps: one of them is in another warp than this writer's.
    const bool first_other = c.other_reader / 32u != t.warp;
    report("write-after-read", p, t, true, site, first_other ? c.other_reader : c.reader, false,
           first_other ? c.other_site : c.read_site, kNoBarrier);
  }
  for (unsigned lanes = c.reader_lanes & ~(1u << t.lane); lanes; lanes &= lanes - 1) {
    const unsigned lane = static_cast<unsigned>(__builtin_ctz(lanes));
    if (!warp_ordered(reader_warp, lane, t.lane, c.read_seq)) {
      report("write-after-read", p, t, true, site, static_cast<uint16_t>(reader_warp * 32 + lane), false,
             c.read_site, kNoSyncwarp);
    }
  }
}

void record_write(ShadowCell& c, const ThreadRef& t, SiteCode site) {
  c.write_epoch = shadow().epoch;
  c.write_seq = shadow().warp_seq[t.warp];
  c.writer = t.linear;
  c.write_site = site;
}

}  // namespace

// -- block and sync events ---------------------------------------------------------------

void race_block_start(BlockRun& block) {
  if (!shadow_of_thread) shadow_of_thread = new RaceShadow();  // kept for the thread's life
  if (shadow().cells.empty()) {
    shadow().dynamic_base = dynamic_shared_base();
    shadow().cells.resize(kMaxDynamicSharedBytes);
  }
  const StaticShared statics = static_shared_of(block.launch->entry.kernel);
  shadow().static_base = statics.data;
  shadow().static_size = statics.size;
  if (shadow().cells.size() < kMaxDynamicSharedBytes + statics.size)
    shadow().cells.resize(kMaxDynamicSharedBytes + statics.size);
  shadow().epoch_counter += 1;
  shadow().first_epoch = shadow().epoch = shadow().epoch_counter;
  shadow().warp_count = block.warp_count;
  std::fill(shadow().warp_seq, shadow().warp_seq + 32, 1u);
  shadow().pair_sync.assign(static_cast<std::size_t>(block.warp_count) * 32 * 32, 0u);
  shadow().block = &block;
}

void race_barrier() {
  shadow().epoch_counter += 1;
  shadow().epoch = shadow().epoch_counter;
}

void race_warp_sync(unsigned warp, unsigned mask) {
  const uint32_t seq = ++shadow().warp_seq[warp];
  for (unsigned a = 0; a < 32; ++a) {
    if (!(mask >> a & 1u)) continue;
    uint32_t* row = &shadow().pair_sync[(warp * 32 + a) * 32];
    for (unsigned b = 0; b < 32; ++b)
      if (mask >> b & 1u) row[b] = seq;
  }
}

// -- accesses ---------------------------------------------------------------------------

bool race_shared_access(const ThreadRef& t, const void* address, std::size_t bytes, bool write, SiteCode site) {
  const auto* p = static_cast<const unsigned char*>(address);
  ShadowCell* c = cell_of(p);
  if (!c) return false;
  ShadowCell* last = cell_of(p + bytes - 1);  // an access never straddles the two regions
  if (!last || last < c) bytes = 1;
  for (std::size_t i = 0; i < bytes; ++i, ++c) {
    if (write) {
      check_write(*c, p + i, t, site, false);
      record_write(*c, t, site);
    } else {
      check_read(*c, p + i, t, site);
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
    check_write(*c, p + i, t, site, false);  // also: a copy into bytes still pending from another
    c->pending = 1;
    c->pending_owner = t.linear;
    c->pending_epoch = shadow().epoch;
    c->pending_site = site;
  }
}

void race_cp_async_landed(const ThreadRef& t, const void* destination, SiteCode site) {
  const auto* p = static_cast<const unsigned char*>(destination);
  for (std::size_t i = 0; i < 16; ++i) {
    ShadowCell* c = cell_of(p + i);
    if (!c) return;
    c->pending = 0;
    check_write(*c, p + i, t, site, true);
    record_write(*c, t, site);
  }
}

void race_global_write(const ThreadRef& t, int tensor, uintptr_t address, std::size_t bytes, SiteCode site) {
  Instrumentation& inst = *shadow().block->launch->instrumentation;
  GlobalShadow* written = inst.written_by[static_cast<std::size_t>(tensor)].get();
  if (!written) return;
  const TensorRange& range = *inst.tensors[static_cast<std::size_t>(tensor)];
  const uint64_t me = ((shadow().block->linear_block + 1) << 10) | t.linear;
  for (std::size_t i = 0; i < bytes; ++i) {
    const uint64_t offset = address + i - range.begin;
    if (offset >= range.bytes) break;
    uint64_t seen = 0;
    if (written->owner[offset].compare_exchange_strong(seen, me, std::memory_order_relaxed)) {
      written->site[offset].store(site, std::memory_order_relaxed);
      continue;
    }
    if ((seen >> 10) == (me >> 10)) continue;  // the same block: its own barriers order it
    const uint64_t other_block = (seen >> 10) - 1;
    const LaunchConfig& config = shadow().block->launch->config;
    const auto coords = [&](uint64_t linear) {
      return "(" + std::to_string(linear % config.grid[0]) + "," + std::to_string(linear / config.grid[0] % config.grid[1]) +
             "," + std::to_string(linear / config.grid[0] / config.grid[1]) + ")";
    };
    fail_race("racecheck: write-after-write hazard in global memory: tensor argument " + std::to_string(range.argument) +
              " element " + std::to_string(offset / static_cast<uint64_t>(std::max(1, range.element_bytes))) +
              " (byte " + std::to_string(offset) + ") is written by " + describe_thread(t) + " of block " +
              coords(shadow().block->linear_block) + " at " + inst.describe_site(site) + " and by " +
              describe_thread(ref_of(static_cast<uint16_t>(seen & 1023u))) + " of block " + coords(other_block) +
              " at " + inst.describe_site(written->site[offset].load(std::memory_order_relaxed)) +
              "; blocks run in no defined order: use an atomic, or give each element one block");
  }
}

}  // namespace fagen_emu
