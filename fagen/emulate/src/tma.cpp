// TMA tile copies, the bulk f32 reduction and bulk async-groups, as late as the PTX ISA allows
// (semantics in fagen_emulate/tma.h; the box geometry is tma_box.cpp's).
//
// Per block (thread_local: one block per OS thread at a time, cleared when a block starts):
// - loads in flight, each with its mbarrier: a load lands when the barrier's phase waits only for
//   transaction bytes and a thread waits on it (mbarrier.cpp calls tma_land_loads then), or at
//   issue when a thread already waits so; landing is the only way a kernel may legally see the
//   bytes, so nothing later is observable;
// - per thread, bulk operations (stores, reductions) by async-group: they read shared memory and
//   write global memory at the bulk wait_group that retires their group.
#include "tma_box.h"

#include <fagen_emulate/mbarrier.h>
#include <fagen_emulate/tma.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace fagen_emu {
namespace {

struct InFlightLoad {
  void* bar;
  unsigned char* destination;
  EmulatedTensorMap map;
  BoxShape shape;
  int32_t coords[kTensorMapMaxRank];
  unsigned thread;
  Site site;
};

enum class BulkKind { tensor_store, reduce_add_f32 };

struct BulkOperation {
  BulkKind kind;
  uint32_t group;
  const unsigned char* source;
  std::vector<unsigned char> issued;  // the source's bytes at issue: they must not change before the read
  EmulatedTensorMap map;              // tensor_store
  BoxShape shape;
  int32_t coords[kTensorMapMaxRank];
  float* destination;                 // reduce_add_f32
  Site site;
};

struct ThreadBulk {
  uint32_t committed = 0;
  std::vector<BulkOperation> operations;  // issued, not yet completed, in issue order
  // Retired by a wait_group.read alone: their source is read, but the ISA does not say their
  // writes are done until a wait_group (without .read) retires their group too.
  std::vector<std::pair<uint32_t, Site>> unconfirmed;  // (group, issue site)
};

thread_local std::vector<InFlightLoad> loads;
thread_local std::vector<ThreadBulk> bulk;

unsigned me() { return current_fiber->coords.linear; }

ThreadBulk& my_bulk() {
  const unsigned threads = current_fiber->block->thread_count;
  if (bulk.size() < threads) bulk.resize(threads);
  return bulk[me()];
}

void check_rank(const EmulatedTensorMap& map, int rank, const char* op, Site site) {
  if (map.rank != rank) fail(site, "%s.%dd with a tensor map of rank %d", op, rank, map.rank);
}

bool still_poisoned(const unsigned char* bytes, std::size_t count) {
  return std::all_of(bytes, bytes + count, [](unsigned char b) { return b == kGarbageByte; });
}

void land(const InFlightLoad& load) {
  if (!still_poisoned(load.destination, load.shape.bytes)) {
    fail(load.site, "shared memory at %p, the destination of a TMA load thread %u issued here, was written while "
                    "the load was in flight", static_cast<void*>(load.destination), load.thread);
  }
  copy_box_in(load.destination, load.map, load.shape, load.coords, load.site);
  tma_load_landed(load.destination, load.bar);
  mbarrier_complete_tx(load.bar, static_cast<uint32_t>(load.shape.bytes), load.site);
}

void add_f32(float* destination, float value) {
  // Other blocks may reduce into the same floats on other OS threads: an atomic add, as the GPU's.
  auto* word = reinterpret_cast<uint32_t*>(destination);
  uint32_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
  for (;;) {
    float sum;
    std::memcpy(&sum, &seen, sizeof sum);
    sum += value;
    uint32_t next;
    std::memcpy(&next, &sum, sizeof next);
    if (__atomic_compare_exchange_n(word, &seen, next, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
  }
}

void complete(const BulkOperation& operation) {
  if (std::memcmp(operation.source, operation.issued.data(), operation.issued.size()) != 0) {
    fail(operation.site, "the shared source of a bulk %s issued here changed before the bulk wait_group that "
                         "retires it: the async proxy may read it any time until then",
         operation.kind == BulkKind::tensor_store ? "tensor store" : "reduction");
  }
  if (operation.kind == BulkKind::reduce_add_f32) {
    const std::size_t count = operation.issued.size() / sizeof(float);
    for (std::size_t i = 0; i < count; ++i) {
      float value;
      std::memcpy(&value, operation.issued.data() + i * sizeof value, sizeof value);
      add_f32(operation.destination + i, value);
    }
    return;
  }
  std::vector<unsigned char> dense(operation.shape.bytes);
  unswizzle_box(operation.source, operation.map, operation.shape, dense.data());
  const unsigned bytes = operation.map.element_bytes;
  copy_box_out(operation.map, operation.shape, operation.coords, dense.data(), operation.site,
               [bytes](unsigned char* to, const unsigned char* from) { std::memcpy(to, from, bytes); });
}

void issue(BulkOperation operation, std::size_t bytes) {
  ThreadBulk& mine = my_bulk();
  operation.group = mine.committed;
  operation.issued.assign(operation.source, operation.source + bytes);
  async_read_issued(operation.source, bytes, operation.site);
  mine.operations.push_back(std::move(operation));
}

}  // namespace

void tma_load(void* shared_dst, const EmulatedTensorMap* map, int rank, const int32_t* coords, void* bar, Site site) {
  const char op[] = "cp.async.bulk.tensor (load)";
  const BoxShape shape = box_shape(*map, site);
  check_rank(*map, rank, op, site);
  check_shared_box(shared_dst, *map, shape, op, site);
  check_box_meets_tensor(*map, shape, coords, op, site);
  InFlightLoad load{bar, static_cast<unsigned char*>(shared_dst), *map, shape, {}, me(), site};
  std::copy(coords, coords + rank, load.coords);
  std::memset(shared_dst, kGarbageByte, shape.bytes);  // nothing has landed yet
  tma_load_issued(shared_dst, shape.bytes, bar, site);
  loads.push_back(load);
  if (mbarrier_waits_for_tx_only(bar)) tma_land_loads(bar);
}

void tma_land_loads(void* bar) {
  std::vector<InFlightLoad> landing;
  auto keep = std::stable_partition(loads.begin(), loads.end(), [bar](const InFlightLoad& l) { return l.bar != bar; });
  landing.assign(keep, loads.end());   // taken out first: landing completes phases, which may call back
  loads.erase(keep, loads.end());
  for (const InFlightLoad& load : landing) land(load);
}

void tma_store(const EmulatedTensorMap* map, int rank, const int32_t* coords, const void* shared_src, Site site) {
  const char op[] = "cp.async.bulk.tensor (store)";
  const BoxShape shape = box_shape(*map, site);
  check_rank(*map, rank, op, site);
  check_shared_box(shared_src, *map, shape, op, site);
  BulkOperation operation{BulkKind::tensor_store, 0, static_cast<const unsigned char*>(shared_src), {}, *map, shape,
                          {}, nullptr, site};
  std::copy(coords, coords + rank, operation.coords);
  issue(std::move(operation), shape.bytes);
}

void bulk_reduce_add_f32(float* global_dst, const float* shared_src, uint32_t bytes, Site site) {
  if (bytes == 0 || bytes % 16 != 0) {
    fail(site, "cp.reduce.async.bulk of %u bytes: a multiple of 16 is required", bytes);
  }
  if (reinterpret_cast<uintptr_t>(global_dst) % 16 || reinterpret_cast<uintptr_t>(shared_src) % 16) {
    fail(site, "cp.reduce.async.bulk: source %p and destination %p must be 16-byte aligned",
         static_cast<const void*>(shared_src), static_cast<void*>(global_dst));
  }
  check_dynamic_shared_range(shared_src, bytes, "cp.reduce.async.bulk", site);
  issue(BulkOperation{BulkKind::reduce_add_f32, 0, reinterpret_cast<const unsigned char*>(shared_src), {}, {}, {}, {},
                      global_dst, site},
        bytes);
}

void bulk_commit_group(Site) { my_bulk().committed += 1; }

namespace {

// wait_group(.read) N: retires every committed group of this thread but the N most recent. The
// twin writes global memory here either way (as late as it may); `.read` leaves the writes
// unconfirmed for semaphore_arrive's check.
void retire_groups(int pending_groups, bool read_only, Site site) {
  if (pending_groups < 0) fail(site, "cp.async.bulk.wait_group %d: the count must be >= 0", pending_groups);
  ThreadBulk& mine = my_bulk();
  const auto kept = static_cast<uint32_t>(pending_groups);
  const uint32_t first_kept = mine.committed > kept ? mine.committed - kept : 0;
  std::vector<BulkOperation> remaining;
  for (BulkOperation& operation : mine.operations) {
    if (operation.group < first_kept) {
      complete(operation);
      async_read_retired(operation.source, operation.issued.size(), site);
      if (read_only) mine.unconfirmed.emplace_back(operation.group, operation.site);
    } else {
      remaining.push_back(std::move(operation));
    }
  }
  mine.operations = std::move(remaining);
  if (!read_only) {
    auto& list = mine.unconfirmed;
    list.erase(std::remove_if(list.begin(), list.end(), [first_kept](const auto& retired) {
                 return retired.first < first_kept;
               }), list.end());
  }
}

}  // namespace

void bulk_wait_group(int pending_groups, Site site) { retire_groups(pending_groups, false, site); }

void bulk_wait_group_read(int pending_groups, Site site) { retire_groups(pending_groups, true, site); }

std::string bulk_writes_in_flight() {
  const ThreadBulk& mine = my_bulk();
  if (!mine.operations.empty()) return "the bulk operation issued at " + format_site(mine.operations.front().site);
  if (!mine.unconfirmed.empty()) {
    return "the bulk operation issued at " + format_site(mine.unconfirmed.front().second) +
           " (a wait_group.read retired it: its source is read, its writes may not be done)";
  }
  return {};
}

void tma_block_start() {
  loads.clear();
  bulk.clear();
}

std::string tma_block_end() {
  for (std::size_t thread = 0; thread < bulk.size(); ++thread) {
    if (bulk[thread].operations.empty()) continue;
    const Site site = bulk[thread].operations.front().site;
    return "thread " + std::to_string(thread) + " exited with a bulk operation issued at " + format_site(site) +
           " still reading shared memory (no cp.async.bulk.wait_group retired it)";
  }
  return {};
}

}  // namespace fagen_emu
