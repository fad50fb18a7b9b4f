// wgmma.mma_async .m64nNk16 .f32.{f16,bf16}, .m64nNk32 .f32.{e4m3,e5m2} and its fence /
// commit_group / wait_group, as warpgroup rendezvous (warpgroup.cpp), with the shared-memory
// descriptors decoded here.
//
// Descriptor (PTX ISA "Matrix Descriptor Format"): start >> 4 in bits 13-0, LBO >> 4 in 29-16,
// SBO >> 4 in 45-32, base offset in 51-49, swizzle in 63-62 (0 none, 1 128B, 2 64B, 3 32B).
// Element (mn, k) of an operand (shown for 16-bit elements, 8 per 16-byte row of a core matrix;
// 8-bit ones: 16 per row, 1 byte each; W the swizzle width in bytes) sits at start + offset,
// swizzled on the absolute address:
//   K-major  none:  (mn%8)*16 + (mn/8)*SBO + (k/8)*LBO + (k%8)*2
//   K-major  W:     (mn%8)*W  + (mn/8)*SBO + k*2
//   MN-major none:  (k%8)*16  + (k/8)*LBO  + (mn/8)*SBO + (mn%8)*2
//   MN-major W:     (k%8)*W   + (k/8)*SBO  + (mn/(W/2))*LBO + (mn%(W/2))*2
//   swizzle: address bits [4, 4+b) ^= bits [7, 7+b), b = 3, 2, 1 for 128B, 64B, 32B.
// Fragments (thread t of the warpgroup, w = t/32, g = (t%32)/4, q = t%4):
//   d[i]: D[16w + g + 8*((i/2)%2)][8*(i/4) + 2q + i%2]
//   a[r]: A[16w + g + 8*(r%2)][8*(r/2) + 2q + {0, 1}], lower k in the low half
//         (8-bit: A[16w + g + 8*(r%2)][16*(r/2) + 4q + {0..3}], lowest k in the low byte).
// Timing (fagen_emulate/wgmma.h): NaN accumulators from issue to the retiring wait; shared
// operands read at issue and again at the wait (a fault if they differ); a missing wgmma.fence
// found by comparing registers with what the twin last left in them.
#include "runtime_internal.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace fagen_emu {

namespace {

const char kWgmmaSS[] = "wgmma.mma_async (A, B from shared memory)";
const char kWgmmaRS[] = "wgmma.mma_async (A from registers)";
const char kFence[] = "wgmma.fence";
const char kCommit[] = "wgmma.commit_group";
const char kWait[] = "wgmma.wait_group";

// One thread's operands of a wgmma, as it passes them to the rendezvous.
struct Issue {
  WgmmaInput a_type, b_type;
  int n, scale_d, scale_a, scale_b, trans_a, trans_b;
  uint64_t a_desc, b_desc;
  const uint32_t* a_regs;  // null: A from shared memory
  float* d;
};

// An operand tile in shared memory: the host address of element (mn, k) at mn * K + k, and
// its bits as read at issue (an 8-bit element in the low byte).
struct Tile {
  std::vector<const unsigned char*> where;
  std::vector<uint16_t> bits;
  int bytes = 2;
};

struct InFlight {
  Site site;
  Issue issue;  // thread 0's (the rendezvous checked that the others agree)
  uint32_t group = 0;
  bool a_from_registers = false;
  Tile a, b;                    // a unused when A came from registers
  std::vector<uint16_t> a_regs;  // 64 x K A bits from registers
  float* d[128] = {};
  uint32_t* a_where[128] = {};   // A from registers: each thread's four, poisoned while in flight
  uint32_t a_saved[128][4] = {};  // ... and what they held at issue, restored by the retiring wait
  uint32_t a_poison = 0;         // the NaN pattern written there (0 when an earlier op in flight owns them)
  bool chained = false;          // C is the result of an earlier wgmma in flight on the same d
  std::vector<float> c;          // else C as it was at issue, thread-major
};

// What the twin last left in some registers (accumulators or A fragments) of all 128 threads,
// and the fence count then: a later wgmma finding them changed with no fence since is a fault.
struct Registers {
  std::vector<void*> where;  // per thread
  std::size_t bytes = 0;     // per thread
  std::vector<unsigned char> seen;
  uint64_t fences = 0;
};

}  // namespace

struct WgmmaState {
  std::vector<InFlight> in_flight;  // in issue order
  uint32_t committed = 0;
  uint64_t fences = 0;
  bool fenced_since_wait = false;
  std::vector<Registers> registers;
};

namespace {

// The kernel's return address of the wgmma op being completed (every thread calls it from the
// same site), so that racecheck can name the .cu line.
__thread const void* wgmma_caller = nullptr;

// Racecheck: the wgmma reads its operands through the async proxy on behalf of its warpgroup,
// attributed to the warpgroup's thread 0, from issue until the retiring wait. A thread's write to
// an operand tile must happen before the issue and be followed, in the writer, by
// fence.proxy.async (a TMA load's bytes, written by the async proxy, need no fence); a write
// before the retiring wait is a hazard.
void operand_read(unsigned group, const unsigned char* byte, int bytes, SiteCode site, bool retired) {
  const Fiber& reader = current_fiber->block->fibers[128 * group];
  async_operand_read(thread_ref(reader), byte, static_cast<std::size_t>(bytes), retired, site);
}

WgmmaState& wgmma_state(const WarpgroupRendezvous& w) {
  auto& slot = current_fiber->block->warpgroups[w.group].wgmma;
  if (!slot) slot = std::make_shared<WgmmaState>();
  return *slot;
}

const Issue& issue_of(const WarpgroupRendezvous& w, unsigned t) { return *static_cast<const Issue*>(w.in[t]); }

// Bytes per element; K of .m64nNk{K} is 32 bytes of it.
int element_bytes(WgmmaInput type) { return type == WgmmaInput::f16 || type == WgmmaInput::bf16 ? 2 : 1; }
int k_of(WgmmaInput type) { return 32 / element_bytes(type); }

// e4m3: bias 7, no infinities, S.1111.111 is NaN; e5m2: bias 15, IEEE-like (infinities, NaNs).
double decode_fp8(unsigned bits, int exponent_bits, bool e4m3) {
  const int mantissa_bits = 7 - exponent_bits, bias = (1 << (exponent_bits - 1)) - 1;
  const unsigned exponent = bits >> mantissa_bits & ((1u << exponent_bits) - 1);
  const unsigned mantissa = bits & ((1u << mantissa_bits) - 1);
  const double sign = bits & 0x80u ? -1.0 : 1.0;
  const unsigned top = (1u << exponent_bits) - 1;
  if (e4m3 && exponent == top && mantissa == 7) return std::nan("");
  if (!e4m3 && exponent == top) return mantissa ? std::nan("") : sign * HUGE_VAL;
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - bias - mantissa_bits);
  return sign * std::ldexp(mantissa + (1u << mantissa_bits), static_cast<int>(exponent) - bias - mantissa_bits);
}

double decode(WgmmaInput type, uint16_t bits) {
  switch (type) {
    case WgmmaInput::f16: return __half2float(__ushort_as_half(bits));
    case WgmmaInput::bf16: return bit_cast<float>(static_cast<uint32_t>(bits) << 16);
    case WgmmaInput::e4m3: return decode_fp8(bits & 0xffu, 4, true);
    case WgmmaInput::e5m2: return decode_fp8(bits & 0xffu, 5, false);
  }
  return 0.0;
}

uint32_t swizzle(uint32_t address, unsigned mode) {
  const unsigned bits = mode == 1 ? 3 : mode == 2 ? 2 : mode == 3 ? 1 : 0;  // a descriptor's 128B, 64B, 32B
  return static_cast<uint32_t>(swizzled_shared_address(address, bits));
}

// The shared-window address of element (mn, k) of the operand `desc` describes (elements of
// `size` bytes, so a 16-byte core-matrix row holds 16 / size of them).
uint32_t element_address(uint64_t desc, bool mn_major, int mn, int k, uint32_t size) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fff) << 4;
  const uint32_t lbo = static_cast<uint32_t>(desc >> 16 & 0x3fff) << 4;
  const uint32_t sbo = static_cast<uint32_t>(desc >> 32 & 0x3fff) << 4;
  const unsigned mode = static_cast<unsigned>(desc >> 62);
  const uint32_t width = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 16;
  const uint32_t m = static_cast<uint32_t>(mn), kk = static_cast<uint32_t>(k);
  const uint32_t core = 16 / size;  // elements in a 16-byte core-matrix row
  uint32_t offset;
  if (!mn_major) {
    offset = mode == 0 ? (m % 8) * 16 + (m / 8) * sbo + (kk / core) * lbo + (kk % core) * size
                       : (m % 8) * width + (m / 8) * sbo + kk * size;
  } else {
    const uint32_t per_row = width / size;  // elements of MN in one swizzle-width row
    offset = mode == 0 ? (kk % 8) * 16 + (kk / 8) * lbo + (m / core) * sbo + (m % core) * size
                       : (kk % 8) * width + (kk / 8) * sbo + (m / per_row) * lbo + (m % per_row) * size;
  }
  return swizzle(start + offset, mode);
}

Tile read_tile(uint64_t desc, bool mn_major, int rows, WgmmaInput type, const char* name, unsigned group,
               Site site) {
  const bool instrumented = instrumenting();
  const SiteCode code = instrumented ? call_site(wgmma_caller, site) : 0;
  if ((desc >> 49 & 7) != 0) {
    fail(site, "wgmma: %s descriptor 0x%016llx has base offset %u: the emulator models base offset 0 only", name,
         static_cast<unsigned long long>(desc), static_cast<unsigned>(desc >> 49 & 7));
  }
  const uint64_t size = current_fiber->block->launch->config.shared_mem_bytes;
  const int bytes = element_bytes(type), depth = k_of(type);
  Tile tile;
  tile.bytes = bytes;
  tile.where.resize(static_cast<std::size_t>(rows) * depth);
  tile.bits.assign(tile.where.size(), 0);
  for (int mn = 0; mn < rows; ++mn) {
    for (int k = 0; k < depth; ++k) {
      const uint32_t address = element_address(desc, mn_major, mn, k, static_cast<uint32_t>(bytes));
      if (address < kDynamicSharedWindowBase || address + bytes > kDynamicSharedWindowBase + size) {
        fail(site, "wgmma: %s element (%d, %d) of descriptor 0x%016llx is at shared address 0x%x, outside the "
                   "launch's %llu bytes of dynamic shared memory (at 0x%x)", name, mn, k,
             static_cast<unsigned long long>(desc), address, static_cast<unsigned long long>(size),
             kDynamicSharedWindowBase);
      }
      const unsigned char* byte = dynamic_shared_base() + (address - kDynamicSharedWindowBase);
      tile.where[static_cast<std::size_t>(mn) * depth + k] = byte;
      if (instrumented) operand_read(group, byte, bytes, code, /*retired=*/false);
      std::memcpy(&tile.bits[static_cast<std::size_t>(mn) * depth + k], byte, static_cast<std::size_t>(bytes));
    }
  }
  return tile;
}

// Reads the tile again at the retiring wait: the ISA lets the wgmma read it any time until then.
void reread_tile(Tile& tile, const char* name, const InFlight& op, unsigned group, Site wait_site) {
  const bool instrumented = instrumenting();
  const SiteCode code = instrumented ? call_site(wgmma_caller, wait_site) : 0;
  for (std::size_t i = 0; i < tile.where.size(); ++i) {
    uint16_t now = 0;
    std::memcpy(&now, tile.where[i], static_cast<std::size_t>(tile.bytes));
    if (now != tile.bits[i]) {
      const uint32_t address = static_cast<uint32_t>(tile.where[i] - dynamic_shared_base()) + kDynamicSharedWindowBase;
      fail(wait_site, "the wgmma issued at %s reads %s element (%zu, %zu) at shared address 0x%x, which changed "
                      "between its issue and the wgmma.wait_group that retires it (0x%04x -> 0x%04x)",
           format_site(op.site).c_str(), name, i / k_of(op.issue.a_type), i % k_of(op.issue.a_type), address,
           tile.bits[i], now);
    }
    tile.bits[i] = now;
    if (instrumented) operand_read(group, tile.where[i], tile.bytes, code, /*retired=*/true);
  }
}

Registers* find_registers(WgmmaState& state, void* const* where, std::size_t bytes) {
  for (Registers& r : state.registers)
    if (r.bytes == bytes && std::equal(r.where.begin(), r.where.end(), where)) return &r;
  return nullptr;
}

// What the twin leaves in the registers `where` (128 threads, `bytes` each) now.
void remember_registers(WgmmaState& state, void* const* where, std::size_t bytes) {
  Registers* r = find_registers(state, where, bytes);
  if (!r) {
    state.registers.emplace_back();
    r = &state.registers.back();
    r->where.assign(where, where + 128);
    r->bytes = bytes;
  }
  r->seen.resize(128 * bytes);
  for (unsigned t = 0; t < 128; ++t) std::memcpy(&r->seen[t * bytes], where[t], bytes);
  r->fences = state.fences;
}

// The ISA's rule: a wgmma.fence between a thread's register write and the wgmma that uses it.
// `first_thread`: the block's id of the warpgroup's thread 0, for the message.
void check_fence(WgmmaState& state, void* const* where, std::size_t bytes, const char* what, unsigned first_thread,
                 Site site) {
  const Registers* r = find_registers(state, where, bytes);
  if (!r) {
    if (!state.fenced_since_wait) {
      fail(site, "wgmma uses %s no wgmma.fence has ordered since they were written (none since the last "
                 "wgmma.wait_group or the kernel's start)", what);
    }
    return;
  }
  if (r->fences != state.fences) return;
  for (unsigned t = 0; t < 128; ++t) {
    if (std::memcmp(&r->seen[t * bytes], where[t], bytes) != 0) {
      fail(site, "wgmma uses %s that thread %u wrote after the last wgmma left them, with no wgmma.fence in "
                 "between", what, first_thread + t);
    }
  }
}

void check_uniform(const WarpgroupRendezvous& w) {
  const Issue& first = issue_of(w, 0);
  for (unsigned t = 1; t < 128; ++t) {
    const Issue& other = issue_of(w, t);
    if (other.a_desc != first.a_desc || other.b_desc != first.b_desc || other.scale_d != first.scale_d ||
        other.n != first.n || other.a_type != first.a_type || other.b_type != first.b_type) {
      fail(w.site, "wgmma: thread %u passes descriptors 0x%016llx / 0x%016llx and scale-d %d, thread %u "
                   "0x%016llx / 0x%016llx and %d: they must agree across the warpgroup", 128 * w.group + t,
           static_cast<unsigned long long>(other.a_desc), static_cast<unsigned long long>(other.b_desc),
           other.scale_d, 128 * w.group, static_cast<unsigned long long>(first.a_desc),
           static_cast<unsigned long long>(first.b_desc), first.scale_d);
    }
  }
}

bool same_accumulator(const InFlight& op, float* const* d) { return std::equal(op.d, op.d + 128, d); }

// A from registers is poisoned from issue to the retiring wait (NaN in every element: 0x7fff in
// 16 bits, 0x7f in 8): the PTX ISA leaves touching those registers in between undefined, so a read
// sees NaN, and a write is found at the wait, where the twin checks the poison is intact before
// it restores the values. An op whose A another op in flight already poisoned reads that op's
// saved values and leaves the registers to it.
void poison_a_registers(WgmmaState& state, InFlight& op, const WarpgroupRendezvous& w) {
  const InFlight* owner = nullptr;
  for (const InFlight& earlier : state.in_flight) {
    if (earlier.a_from_registers && earlier.a_poison && earlier.a_where[0] == issue_of(w, 0).a_regs)
      owner = &earlier;
  }
  void* where[128];
  for (unsigned t = 0; t < 128; ++t) {
    op.a_where[t] = const_cast<uint32_t*>(issue_of(w, t).a_regs);
    where[t] = op.a_where[t];
    std::memcpy(op.a_saved[t], owner ? owner->a_saved[t] : op.a_where[t], sizeof(op.a_saved[t]));
  }
  if (owner) return;
  op.a_poison = element_bytes(op.issue.a_type) == 2 ? 0x7fff7fffu : 0x7f7f7f7fu;
  for (unsigned t = 0; t < 128; ++t)
    for (unsigned r = 0; r < 4; ++r) op.a_where[t][r] = op.a_poison;
  remember_registers(state, where, 4 * sizeof(uint32_t));
}

// At the wait that retires the last op in flight reading them: A's poison must be intact (else the
// kernel wrote those registers, or let the compiler reuse them, while a wgmma could still read
// them: keep them live with wgmma_fence_fragments until the wait), then their values come back.
void restore_a_registers(WgmmaState& state, const InFlight& op, unsigned group, Site wait_site) {
  void* where[128];
  for (unsigned t = 0; t < 128; ++t) {
    for (unsigned r = 0; r < 4; ++r) {
      if (op.a_where[t][r] != op.a_poison) {
        fail(wait_site, "wgmma (issued at %s:%d): thread %u's A register %u changed between its issue and the "
                        "wgmma.wait_group that retires it (0x%08x, not the poison 0x%08x the twin left): a write "
                        "to an in-flight wgmma's A registers, or their registers reused", op.site.file,
             op.site.line, 128 * group + t, r, op.a_where[t][r], op.a_poison);
      }
    }
    std::memcpy(op.a_where[t], op.a_saved[t], sizeof(op.a_saved[t]));
    where[t] = op.a_where[t];
  }
  remember_registers(state, where, 4 * sizeof(uint32_t));
}

void compute_issue(WarpgroupRendezvous& w) {
  WgmmaState& state = wgmma_state(w);
  check_uniform(w);
  InFlight op;
  op.site = w.site;
  op.issue = issue_of(w, 0);
  op.group = state.committed;
  op.a_from_registers = op.issue.a_regs != nullptr;
  const std::size_t d_bytes = sizeof(float) * static_cast<std::size_t>(op.issue.n / 2);
  void* d_where[128];
  void* a_where[128];
  for (unsigned t = 0; t < 128; ++t) {
    op.d[t] = issue_of(w, t).d;
    d_where[t] = op.d[t];
    a_where[t] = const_cast<uint32_t*>(issue_of(w, t).a_regs);
  }
  check_fence(state, d_where, d_bytes, "accumulators", 128 * w.group, w.site);
  if (op.a_from_registers) {
    check_fence(state, a_where, 4 * sizeof(uint32_t), "A registers", 128 * w.group, w.site);
    poison_a_registers(state, op, w);
    // Register r holds `per` elements, the lowest k in the lowest bits.
    const unsigned depth = static_cast<unsigned>(k_of(op.issue.a_type)), bits = 8u * element_bytes(op.issue.a_type);
    const unsigned per = 32 / bits;
    op.a_regs.resize(64 * depth);
    for (unsigned t = 0; t < 128; ++t) {
      const uint32_t* regs = op.a_saved[t];   // the values at issue (the registers hold poison now)
      const unsigned row = 16 * (t / 32) + (t % 32) / 4, q = t % 4;
      for (unsigned r = 0; r < 4; ++r) {
        const unsigned m = row + 8 * (r % 2), k = depth / 2 * (r / 2) + per * q;
        for (unsigned j = 0; j < per; ++j)
          op.a_regs[m * depth + k + j] = static_cast<uint16_t>(regs[r] >> (bits * j) & ((1u << bits) - 1u));
      }
    }
  } else {
    op.a = read_tile(op.issue.a_desc, op.issue.trans_a != 0, 64, op.issue.a_type, "A", w.group, w.site);
  }
  op.b = read_tile(op.issue.b_desc, op.issue.trans_b != 0, op.issue.n, op.issue.b_type, "B", w.group, w.site);
  for (const InFlight& earlier : state.in_flight) op.chained |= same_accumulator(earlier, op.d);
  if (!op.chained) {
    op.c.resize(128 * static_cast<std::size_t>(op.issue.n / 2));
    for (unsigned t = 0; t < 128; ++t) std::memcpy(&op.c[t * (op.issue.n / 2)], op.d[t], d_bytes);
  }
  const float poison = std::numeric_limits<float>::quiet_NaN();
  for (unsigned t = 0; t < 128; ++t)
    for (int i = 0; i < op.issue.n / 2; ++i) op.d[t][i] = poison;
  remember_registers(state, d_where, d_bytes);
  state.in_flight.push_back(std::move(op));
}

// D = A * B + C for one retired wgmma, written into every thread's accumulators.
void retire(WgmmaState& state, InFlight& op, unsigned group, Site wait_site) {
  const Issue& is = op.issue;
  const int n = is.n;
  if (!op.a_from_registers) reread_tile(op.a, "A", op, group, wait_site);
  reread_tile(op.b, "B", op, group, wait_site);
  const std::vector<uint16_t>& a_bits = op.a_from_registers ? op.a_regs : op.a.bits;
  const unsigned depth = static_cast<unsigned>(k_of(is.a_type));
  std::vector<double> a(64 * depth), b(static_cast<std::size_t>(n) * depth);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = is.scale_a * decode(is.a_type, a_bits[i]);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = is.scale_b * decode(is.b_type, op.b.bits[i]);
  for (unsigned t = 0; t < 128; ++t) {
    const unsigned row0 = 16 * (t / 32) + (t % 32) / 4, q = t % 4;
    for (int i = 0; i < n / 2; ++i) {
      const unsigned m = row0 + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * q + i % 2;
      double sum = 0.0;
      if (is.scale_d) sum = op.chained ? op.d[t][i] : op.c[t * (n / 2) + i];
      for (unsigned k = 0; k < depth; ++k) sum += a[m * depth + k] * b[col * depth + k];
      op.d[t][i] = static_cast<float>(sum);
    }
  }
  void* d_where[128];
  for (unsigned t = 0; t < 128; ++t) d_where[t] = op.d[t];
  remember_registers(state, d_where, sizeof(float) * static_cast<std::size_t>(n / 2));
}

void compute_fence(WarpgroupRendezvous& w) {
  WgmmaState& state = wgmma_state(w);
  state.fences += 1;
  state.fenced_since_wait = true;
}

void compute_commit(WarpgroupRendezvous& w) { wgmma_state(w).committed += 1; }

void compute_wait(WarpgroupRendezvous& w) {
  WgmmaState& state = wgmma_state(w);
  const uint32_t kept = static_cast<uint32_t>(*static_cast<const int*>(w.in[0]));
  const uint32_t first_kept = state.committed > kept ? state.committed - kept : 0;
  std::size_t remaining = 0;
  std::vector<InFlight> retired;
  for (std::size_t i = 0; i < state.in_flight.size(); ++i) {
    if (state.in_flight[i].group < first_kept) {
      retire(state, state.in_flight[i], w.group, w.site);
      if (state.in_flight[i].a_poison) retired.push_back(std::move(state.in_flight[i]));
    } else if (remaining++ != i) {   // never onto itself: a self-move would empty its vectors
      state.in_flight[remaining - 1] = std::move(state.in_flight[i]);
    }
  }
  state.in_flight.resize(remaining);
  for (const InFlight& op : retired) {
    bool still_read = false;   // by an op still in flight, which took A from this one's saved values
    for (const InFlight& kept : state.in_flight)
      still_read |= kept.a_from_registers && kept.a_where[0] == op.a_where[0];
    if (still_read) {
      for (InFlight& kept : state.in_flight) {
        if (kept.a_from_registers && kept.a_where[0] == op.a_where[0] && !kept.a_poison) {
          kept.a_poison = op.a_poison;   // the first of them inherits the poison, and restores it later
          break;
        }
      }
    } else {
      restore_a_registers(state, op, w.group, w.site);
    }
  }
  state.fenced_since_wait = false;
}

void issue(const Issue& operands, const char* op, Site site) {
  if (operands.n < 8 || operands.n > 256 || operands.n % 8 != 0) {
    fail(site, "%s: N = %d, but .m64nNk16 / .m64nNk32 take N a multiple of 8 in [8, 256]", op, operands.n);
  }
  const int bytes = element_bytes(operands.a_type);
  if (bytes != element_bytes(operands.b_type) || (bytes == 2 && operands.a_type != operands.b_type)) {
    fail(site, "%s: A and B types %d and %d: 16-bit inputs must match, 8-bit ones pair with 8-bit ones", op,
         static_cast<int>(operands.a_type), static_cast<int>(operands.b_type));
  }
  if (bytes == 1 && (operands.trans_a || operands.trans_b)) {
    fail(site, "%s: imm-trans with 8-bit inputs: the ISA allows only K-major e4m3 / e5m2 operands", op);
  }
  warpgroup_collective(op, &operands, nullptr, &compute_issue, site);
}

}  // namespace

uint32_t shared_window_address(const void* p, Site site) {
  const auto* base = dynamic_shared_base();
  const auto* byte = static_cast<const unsigned char*>(p);
  if (byte < base || byte > base + kMaxDynamicSharedBytes) {
    fail(site, "shared_window_address(%p): the emulator gives shared-window addresses to dynamic shared memory "
               "only (extern __shared__ smem[])", p);
  }
  return kDynamicSharedWindowBase + static_cast<uint32_t>(byte - base);
}

void wgmma_ss(WgmmaInput a_type, WgmmaInput b_type, int n, float* d, uint64_t a_desc, uint64_t b_desc, int scale_d,
              int scale_a, int scale_b, int trans_a, int trans_b, Site site) {
  wgmma_caller = __builtin_return_address(0);
  const Issue operands{a_type, b_type, n, scale_d != 0, scale_a, scale_b, trans_a, trans_b, a_desc, b_desc, nullptr, d};
  issue(operands, kWgmmaSS, site);
}

void wgmma_rs(WgmmaInput a_type, WgmmaInput b_type, int n, float* d, const uint32_t* a, uint64_t b_desc, int scale_d,
              int scale_a, int scale_b, int trans_b, Site site) {
  wgmma_caller = __builtin_return_address(0);
  const Issue operands{a_type, b_type, n, scale_d != 0, scale_a, scale_b, 0, trans_b, 0, b_desc, a, d};
  issue(operands, kWgmmaRS, site);
}

void wgmma_fence(Site site) { warpgroup_collective(kFence, nullptr, nullptr, &compute_fence, site); }

void wgmma_commit(Site site) { warpgroup_collective(kCommit, nullptr, nullptr, &compute_commit, site); }

void wgmma_wait(int pending_groups, Site site) {
  if (pending_groups < 0 || pending_groups > 7) {
    fail(site, "wgmma.wait_group %d: the count must be in [0, 7]", pending_groups);
  }
  wgmma_caller = __builtin_return_address(0);
  warpgroup_collective(kWait, &pending_groups, nullptr, &compute_wait, site);
}

}  // namespace fagen_emu
