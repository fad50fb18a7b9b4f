// Counters: how a kernel uses memory, from the same hooks as racecheck.
//
// A warp-level access is what one load or store instruction of a warp does:
// the accesses of the warp's lanes at one site, the k-th time each lane gets
// there (lanes of a warp run the same instruction stream, so their k-th visits
// pair up). Its groups are settled at every barrier and at the block's end:
// - global: one request; its 32-byte sectors are the distinct sectors its
//   lanes touch (coalescing: 4 per request for 32 lanes x 4 bytes, contiguous);
// - shared: wavefronts as the banks serve them. 32 banks of 4 bytes; the
//   lanes of a request are served in phases (all 32 lanes for 4-byte accesses,
//   16 for 8-byte, 8 for 16-byte), and a phase takes as many wavefronts as the
//   most distinct 4-byte words any one bank holds (one word is broadcast).
//   Bank conflicts are the wavefronts past the minimum, ceil(words / 32) per
//   phase. ldmatrix: each 8x8 matrix (8 rows of 16 bytes) is one phase.
#include "runtime_internal.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace fagen_emu {

void UniqueBytes::mark(uint64_t offset, std::size_t count) {
  while (count > 0) {
    const uint64_t word = offset / 64, bit = offset % 64;
    const std::size_t take = std::min<std::size_t>(count, 64 - bit);
    const uint64_t mask = (take == 64 ? ~uint64_t{0} : ((uint64_t{1} << take) - 1)) << bit;
    if (word >= words) return;
    bits[word].fetch_or(mask, std::memory_order_relaxed);
    offset += take;
    count -= take;
  }
}

uint64_t UniqueBytes::count() const {
  uint64_t total = 0;
  for (std::size_t i = 0; i < words; ++i) total += static_cast<uint64_t>(__builtin_popcountll(bits[i].load()));
  return total;
}

namespace {

struct LaneAccess {
  uintptr_t address;
  uint32_t bytes;
  uint8_t lane;
};

struct Group {
  bool write = false;
  bool shared = false;
  std::vector<LaneAccess> lanes;
};

struct TensorTotals {
  uint64_t read = 0, written = 0, atomic = 0;
};

struct CounterState {
  LaunchCounters block{};
  std::unordered_map<uint64_t, uint32_t> occurrence;  // (thread, site) -> visits so far
  std::unordered_map<uint64_t, Group> groups;         // (site, visit, warp) -> its lanes
  std::vector<TensorTotals> tensors;
};

// This OS thread's counts: a plain pointer, so each access is one cheap TLS read.
__thread CounterState* state_of_thread = nullptr;
inline CounterState& state() { return *state_of_thread; }

constexpr unsigned kBanks = 32;

// Wavefronts of one phase: the most distinct words in any one bank.
uint64_t phase_wavefronts(const std::vector<uint64_t>& words, uint64_t* minimum) {
  if (words.empty()) {
    *minimum = 0;
    return 0;
  }
  unsigned per_bank[kBanks] = {};
  for (uint64_t word : words) per_bank[word % kBanks] += 1;
  *minimum = (words.size() + kBanks - 1) / kBanks;
  return *std::max_element(per_bank, per_bank + kBanks);
}

void distinct(std::vector<uint64_t>& values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
}

void settle_shared(const Group& group) {
  const uint32_t width = group.lanes.front().bytes;
  const unsigned lanes_per_phase = width >= 16 ? 8 : width >= 8 ? 16 : 32;
  uint64_t wavefronts = 0, conflicts = 0;
  for (unsigned phase = 0; phase < 32 / lanes_per_phase; ++phase) {
    std::vector<uint64_t> words;
    for (const LaneAccess& a : group.lanes) {
      if (a.lane / lanes_per_phase != phase) continue;
      for (uintptr_t w = a.address / 4; w <= (a.address + a.bytes - 1) / 4; ++w) words.push_back(w);
    }
    distinct(words);
    uint64_t minimum = 0;
    const uint64_t taken = phase_wavefronts(words, &minimum);
    wavefronts += taken;
    conflicts += taken - minimum;
  }
  if (group.write) {
    state().block.shared_store_requests += 1;
    state().block.shared_store_wavefronts += wavefronts;
    state().block.shared_store_conflicts += conflicts;
  } else {
    state().block.shared_load_requests += 1;
    state().block.shared_load_wavefronts += wavefronts;
    state().block.shared_load_conflicts += conflicts;
  }
}

void settle_global(const Group& group) {
  std::vector<uint64_t> sectors;
  for (const LaneAccess& a : group.lanes)
    for (uintptr_t s = a.address / 32; s <= (a.address + a.bytes - 1) / 32; ++s) sectors.push_back(s);
  distinct(sectors);
  if (group.write) {
    state().block.global_store_requests += 1;
    state().block.global_store_sectors += sectors.size();
  } else {
    state().block.global_load_requests += 1;
    state().block.global_load_sectors += sectors.size();
  }
}

}  // namespace

void counters_block_start(BlockRun& block) {
  if (!state_of_thread) state_of_thread = new CounterState();  // kept for the thread's life
  state().block = LaunchCounters{};
  state().block.blocks = 1;
  state().occurrence.clear();
  state().groups.clear();
  state().tensors.assign(block.launch->instrumentation->tensors.size(), TensorTotals{});
}

void counters_flush(BlockRun&) {
  for (const auto& entry : state().groups) {
    const Group& group = entry.second;
    if (group.lanes.empty()) continue;
    if (group.shared) {
      settle_shared(group);
    } else {
      settle_global(group);
    }
  }
  state().groups.clear();
}

void counters_block_end(BlockRun& block) {
  Instrumentation& inst = *block.launch->instrumentation;
  std::lock_guard<std::mutex> lock(inst.mutex);
  LaunchCounters& t = inst.totals;
  const LaunchCounters& b = state().block;
  t.blocks += b.blocks;
  t.global_load_requests += b.global_load_requests;
  t.global_load_sectors += b.global_load_sectors;
  t.global_store_requests += b.global_store_requests;
  t.global_store_sectors += b.global_store_sectors;
  t.shared_load_requests += b.shared_load_requests;
  t.shared_load_wavefronts += b.shared_load_wavefronts;
  t.shared_load_conflicts += b.shared_load_conflicts;
  t.shared_store_requests += b.shared_store_requests;
  t.shared_store_wavefronts += b.shared_store_wavefronts;
  t.shared_store_conflicts += b.shared_store_conflicts;
  t.ldmatrix_requests += b.ldmatrix_requests;
  t.ldmatrix_wavefronts += b.ldmatrix_wavefronts;
  t.ldmatrix_conflicts += b.ldmatrix_conflicts;
  t.mma += b.mma;
  t.barriers += b.barriers;
  t.philox_calls += b.philox_calls;
  t.cp_async_copies += b.cp_async_copies;
  t.cp_async_bytes += b.cp_async_bytes;
  t.proxy_fences += b.proxy_fences;
  for (std::size_t i = 0; i < state().tensors.size(); ++i) {
    inst.tensors[i]->read_bytes += state().tensors[i].read;
    inst.tensors[i]->written_bytes += state().tensors[i].written;
    inst.tensors[i]->atomic_bytes += state().tensors[i].atomic;
  }
}

void counters_access(const ThreadRef& thread, uintptr_t address, std::size_t bytes, bool write, bool shared,
                     SiteCode site) {
  const uint64_t visit = state().occurrence[(uint64_t{thread.linear} << 32) | site]++;
  const uint64_t key = (uint64_t{site} << 32) ^ (visit << 5) ^ thread.warp;
  Group& group = state().groups[key];
  group.write = write;
  group.shared = shared;
  group.lanes.push_back(LaneAccess{address, static_cast<uint32_t>(bytes), thread.lane});
}

void counters_tensor_bytes(int tensor, uint64_t offset, std::size_t bytes, bool write, bool atomic) {
  Instrumentation& inst = *current_fiber->block->launch->instrumentation;
  TensorTotals& totals = state().tensors[static_cast<std::size_t>(tensor)];
  const std::size_t i = static_cast<std::size_t>(tensor);
  if (atomic) {
    totals.atomic += bytes;
    if (inst.read_bytes[i]) inst.read_bytes[i]->mark(offset, bytes);
    if (inst.written_bytes[i]) inst.written_bytes[i]->mark(offset, bytes);
  } else if (write) {
    totals.written += bytes;
    if (inst.written_bytes[i]) inst.written_bytes[i]->mark(offset, bytes);
  } else {
    totals.read += bytes;
    if (inst.read_bytes[i]) inst.read_bytes[i]->mark(offset, bytes);
  }
}

void count_barrier() { state().block.barriers += 1; }
void count_mma_op() { state().block.mma += 1; }
void count_philox() { state().block.philox_calls += 1; }
void count_cp_async_copy(int src_bytes) {
  state().block.cp_async_copies += 1;
  state().block.cp_async_bytes += static_cast<uint64_t>(src_bytes);
}

void count_proxy_fence_op() { state().block.proxy_fences += 1; }

void count_ldmatrix_rows(const void* const* rows, int matrices) {
  uint64_t wavefronts = 0, conflicts = 0;
  for (int k = 0; k < matrices; ++k) {
    std::vector<uint64_t> words;
    for (int r = 0; r < 8; ++r) {
      const auto address = reinterpret_cast<uintptr_t>(rows[8 * k + r]);
      for (int w = 0; w < 4; ++w) words.push_back(address / 4 + static_cast<uintptr_t>(w));
    }
    distinct(words);
    uint64_t minimum = 0;
    const uint64_t taken = phase_wavefronts(words, &minimum);
    wavefronts += taken;
    conflicts += taken - minimum;
  }
  state().block.ldmatrix_requests += 1;
  state().block.ldmatrix_wavefronts += wavefronts;
  state().block.ldmatrix_conflicts += conflicts;
}

}  // namespace fagen_emu
