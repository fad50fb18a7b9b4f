// The hooks of an instrumented kernel module, and the dispatch to racecheck
// and the counters.
//
// An instrumented module is compiled with `-fsanitize=thread` and linked
// without libtsan: the compiler then calls __tsan_read4(address) and the like
// before every load and store the kernel makes, and this runtime defines
// those functions itself. Accesses outside a running block, or to memory that
// is neither shared memory nor a registered tensor (the fiber's stack, the
// runtime's own state), return at once.
#include "runtime_internal.h"

#include <dlfcn.h>

#include <algorithm>

namespace fagen_emu {
namespace {

// What the hooks need about the block running on this OS thread, in one TLS
// object (one TLS lookup per hook call): its instrumentation (null when none),
// the block (its running fiber), and the address ranges an access is sorted by.
struct HookContext {
  Instrumentation* inst;
  BlockRun* block;
  const unsigned char* dynamic_begin;
  const unsigned char* dynamic_end;
  const unsigned char* static_begin;
  const unsigned char* static_end;
  uintptr_t tensors_begin;  // the registered tensors lie in [tensors_begin, tensors_end)
  uintptr_t tensors_end;
};
__thread HookContext hook = {};

inline SiteCode pc_site(const Instrumentation& inst, const void* pc) {
  const auto address = reinterpret_cast<uintptr_t>(pc);
  if (address < inst.module_base || address >= inst.module_end) return kRuntimeSiteBit - 1;  // unknown
  return static_cast<SiteCode>(address - inst.module_base);
}

inline bool shared(const HookContext& h, const unsigned char* p) {
  return (p >= h.dynamic_begin && p < h.dynamic_end) || (p >= h.static_begin && p < h.static_end);
}

inline void on_access(const void* address, std::size_t bytes, bool write, const void* pc) {
  const HookContext& h = hook;
  Instrumentation* inst = h.inst;
  if (__builtin_expect(inst == nullptr, 1)) return;
  const auto* p = static_cast<const unsigned char*>(address);
  const bool is_shared = shared(h, p);
  // Most other accesses are the fiber's own stack: neither shared memory nor a tensor.
  if (!is_shared && (reinterpret_cast<uintptr_t>(p) < h.tensors_begin || reinterpret_cast<uintptr_t>(p) >= h.tensors_end))
    return;
  const Fiber* fiber = h.block->running;
  if (!fiber) return;
  const ThreadRef thread = thread_ref(*fiber);
  const SiteCode site = pc_site(*inst, pc);
  if (is_shared) {
    if (inst->racecheck()) race_shared_access(thread, address, bytes, write, site);
    if (inst->counting()) counters_access(thread, reinterpret_cast<uintptr_t>(address), bytes, write, true, site);
    return;
  }
  global_access(thread, address, bytes, write, false, site);
}

}  // namespace

bool is_shared_address(const void* address) { return shared(hook, static_cast<const unsigned char*>(address)); }

// -- the launch's instrumentation ------------------------------------------------------------

Instrumentation::Instrumentation() = default;
Instrumentation::~Instrumentation() = default;

SiteCode Instrumentation::runtime_site(Site site) {
  std::lock_guard<std::mutex> lock(mutex);
  for (std::size_t i = 0; i < sites.size(); ++i)
    if (sites[i].line == site.line && sites[i].file == site.file) return kRuntimeSiteBit | static_cast<SiteCode>(i);
  sites.push_back(site);
  return kRuntimeSiteBit | static_cast<SiteCode>(sites.size() - 1);
}

std::string Instrumentation::describe_site(SiteCode code) {
  if (code & kRuntimeSiteBit) {
    std::lock_guard<std::mutex> lock(mutex);
    const std::size_t index = code & ~kRuntimeSiteBit;
    return index < sites.size() ? format_site(sites[index]) : "<unknown>";
  }
  // A return address in the kernel module: fagen/emulate/module.py replaces the
  // marker with the .cu line (addr2line on the module, which has debug info).
  char marker[40];
  std::snprintf(marker, sizeof marker, "{{pc:0x%x}}", code);
  return marker;
}

int Instrumentation::tensor_of(uintptr_t address) const {
  // The last tensor starting at or before `address`; tensors do not overlap in practice
  // (views of one storage are registered once).
  auto after = std::upper_bound(tensors.begin(), tensors.end(), address,
                                [](uintptr_t a, const TensorRange* t) { return a < t->begin; });
  while (after != tensors.begin()) {
    --after;
    if (address - (*after)->begin < (*after)->bytes) return static_cast<int>(after - tensors.begin());
    if ((*after)->begin + (*after)->bytes <= address) break;
  }
  return -1;
}

// -- the scheduler's events ------------------------------------------------------------------

bool instrumenting() { return hook.inst != nullptr; }

ThreadRef thread_ref(const Fiber& fiber) {
  return ThreadRef{static_cast<uint16_t>(fiber.coords.linear), static_cast<uint8_t>(fiber.coords.warp),
                   static_cast<uint8_t>(fiber.coords.lane)};
}

void instrument_block_start(BlockRun& block) {
  Instrumentation* inst = block.launch->instrumentation.get();
  if (!inst) {
    hook = HookContext{};
    return;
  }
  const StaticShared statics = static_shared_of(block.launch->entry.kernel);
  const unsigned char* dynamic = dynamic_shared_base();
  hook = HookContext{inst, &block, dynamic, dynamic + kMaxDynamicSharedBytes, statics.data,
                     statics.data ? statics.data + statics.size : nullptr, inst->tensors_begin, inst->tensors_end};
  if (inst->racecheck()) race_block_start(block);
  if (inst->counting()) counters_block_start(block);
}

void instrument_block_end(BlockRun& block) {
  Instrumentation* inst = hook.inst;
  if (!inst) return;
  if (inst->counting() && !block.failed) {
    counters_flush(block);
    counters_block_end(block);
  }
  hook = HookContext{};
}

void instrument_barrier(BlockRun& block) {
  Instrumentation* inst = hook.inst;
  if (!inst) return;
  if (inst->racecheck()) race_barrier();
  if (inst->counting()) {
    count_barrier();
    counters_flush(block);
  }
}

void instrument_warp_sync(BlockRun&, unsigned warp, unsigned mask, bool collective) {
  Instrumentation* inst = hook.inst;
  if (!inst || !inst->racecheck()) return;
  if (collective && !inst->lenient()) return;
  race_warp_sync(warp, mask);
}

// -- accesses the runtime makes for a thread ----------------------------------------------------

SiteCode runtime_site(Site site) { return hook.inst ? hook.inst->runtime_site(site) : 0; }

SiteCode call_site(const void* pc, Site fallback) {
  Instrumentation* inst = hook.inst;
  if (!inst) return 0;
  const SiteCode code = pc_site(*inst, pc);
  return code == kRuntimeSiteBit - 1 ? inst->runtime_site(fallback) : code;
}

void shared_access(const ThreadRef& thread, const void* address, std::size_t bytes, bool write, SiteCode site) {
  if (hook.inst && hook.inst->racecheck()) race_shared_access(thread, address, bytes, write, site);
}

void cp_async_issued(const ThreadRef& thread, const void* destination, SiteCode site) {
  if (hook.inst && hook.inst->racecheck()) race_cp_async_issued(thread, destination, site);
}

void cp_async_landed(const ThreadRef& thread, const void* destination, SiteCode site) {
  if (hook.inst && hook.inst->racecheck()) race_cp_async_landed(thread, destination, site);
}

namespace {
bool racechecking() { return hook.inst && hook.inst->racecheck() && current_fiber; }
unsigned running_thread() { return current_fiber->coords.linear; }
}  // namespace

void mbarrier_released(const void* bar) {
  if (racechecking()) race_mbarrier_release(bar, running_thread());
}

void mbarrier_phase_completed(const void* bar) {
  if (racechecking()) race_mbarrier_phase_completed(bar);
}

void mbarrier_acquired(const void* bar, unsigned thread) {
  if (racechecking()) race_mbarrier_acquire(bar, thread);
}

void named_barrier_arrived(unsigned id) {
  if (racechecking()) race_named_release(id, running_thread());
}

void named_barrier_completed(unsigned id, const unsigned* waiting) {
  if (racechecking()) race_named_completed(id, waiting);
}

void semaphore_release(int* sem) {
  if (racechecking()) {
    race_semaphore_release(sem);  // the increment, under the lock that orders the clocks
  } else {
    __atomic_fetch_add(sem, 1, __ATOMIC_ACQ_REL);
  }
  if (hook.inst && current_fiber)  // counters: an atomic read-modify-write of the counter
    global_access(thread_ref(*current_fiber), sem, sizeof(int), true, true, kRuntimeSiteBit - 1);
}

void semaphore_acquired(BlockRun&, const int* sem) {
  // Also from the scheduler (a parked wait released, no fiber running): the block's OS thread.
  if (hook.inst && hook.inst->racecheck()) race_semaphore_acquire(sem);
}

void proxy_fence_ran() {
  if (racechecking()) race_proxy_fence(running_thread());
}

void tma_load_issued(void* destination, std::size_t bytes, const void* bar, Site site) {
  if (racechecking())
    race_tma_load_issued(thread_ref(*current_fiber), destination, bytes, bar, hook.inst->runtime_site(site));
}

void tma_load_landed(const void* destination, const void* bar) {
  if (racechecking()) race_tma_load_landed(destination, bar);
}

void async_read_issued(const void* source, std::size_t bytes, Site site) {
  if (racechecking()) race_async_read_issued(thread_ref(*current_fiber), source, bytes, hook.inst->runtime_site(site));
}

void async_operand_read(const ThreadRef& thread, const void* source, std::size_t bytes, bool retired, SiteCode site) {
  if (!racechecking()) return;
  if (retired) {
    race_async_read_retired(thread, source, bytes, site);
  } else {
    race_async_read_issued(thread, source, bytes, site);
  }
}

void async_read_retired(const void* source, std::size_t bytes, Site site) {
  if (racechecking())
    race_async_read_retired(thread_ref(*current_fiber), source, bytes, hook.inst->runtime_site(site));
}

void global_access(const ThreadRef& thread, const void* address, std::size_t bytes, bool write, bool atomic,
                   SiteCode site) {
  Instrumentation* inst = hook.inst;
  if (!inst || bytes == 0) return;
  const auto a = reinterpret_cast<uintptr_t>(address);
  const int tensor = inst->tensor_of(a);
  if (tensor < 0) return;
  if (inst->counting()) {
    counters_tensor_bytes(tensor, a - inst->tensors[static_cast<std::size_t>(tensor)]->begin, bytes, write, atomic);
    if (!atomic) counters_access(thread, a, bytes, write, false, site);
  }
  if (inst->racecheck() && write && !atomic) race_global_write(thread, tensor, a, bytes, site);
}

void count_mma() {
  if (hook.inst && hook.inst->counting()) count_mma_op();
}

void count_ldmatrix(const void* const* row_addresses, int matrices) {
  if (hook.inst && hook.inst->counting()) count_ldmatrix_rows(row_addresses, matrices);
}

void count_cp_async(int src_bytes) {
  if (hook.inst && hook.inst->counting()) count_cp_async_copy(src_bytes);
}

void count_proxy_fence() {
  if (hook.inst && hook.inst->counting()) count_proxy_fence_op();
}

void count_philox_call() {
  if (hook.inst && hook.inst->counting()) count_philox();
}

}  // namespace fagen_emu

// -- ThreadSanitizer's instrumentation ABI -----------------------------------------------------
//
// What GCC's and Clang's -fsanitize=thread emit calls to. Memory orders are
// the __ATOMIC_* values; the atomics do what they name (sequentially
// consistent, a superset of every order) and count as atomic accesses.

#define FAGEN_TSAN extern "C" __attribute__((visibility("default")))

namespace {
using a8 = char;
using a16 = short;
using a32 = int;
using a64 = long long;

template <class T>
void atomic_seen(volatile T* address, bool write) {
  const ::fagen_emu::Fiber* fiber = ::fagen_emu::current_fiber;
  if (fiber && ::fagen_emu::instrumenting())
    ::fagen_emu::global_access(::fagen_emu::thread_ref(*fiber), const_cast<T*>(address), sizeof(T), write, true,
                               ::fagen_emu::kRuntimeSiteBit - 1);
}
}  // namespace

#define FAGEN_TSAN_ACCESS(bytes)                                                                    \
  FAGEN_TSAN void __tsan_read##bytes(void* p) {                                                     \
    fagen_emu::on_access_hook(p, bytes, false, __builtin_return_address(0));                        \
  }                                                                                                 \
  FAGEN_TSAN void __tsan_write##bytes(void* p) {                                                    \
    fagen_emu::on_access_hook(p, bytes, true, __builtin_return_address(0));                         \
  }                                                                                                 \
  FAGEN_TSAN void __tsan_unaligned_read##bytes(void* p) {                                           \
    fagen_emu::on_access_hook(p, bytes, false, __builtin_return_address(0));                        \
  }                                                                                                 \
  FAGEN_TSAN void __tsan_unaligned_write##bytes(void* p) {                                          \
    fagen_emu::on_access_hook(p, bytes, true, __builtin_return_address(0));                         \
  }                                                                                                 \
  FAGEN_TSAN void __tsan_volatile_read##bytes(void* p) {                                            \
    fagen_emu::on_access_hook(p, bytes, false, __builtin_return_address(0));                        \
  }                                                                                                 \
  FAGEN_TSAN void __tsan_volatile_write##bytes(void* p) {                                           \
    fagen_emu::on_access_hook(p, bytes, true, __builtin_return_address(0));                         \
  }

namespace fagen_emu {
void on_access_hook(const void* address, std::size_t bytes, bool write, const void* pc) {
  on_access(address, bytes, write, pc);
}
}  // namespace fagen_emu

FAGEN_TSAN_ACCESS(1)
FAGEN_TSAN_ACCESS(2)
FAGEN_TSAN_ACCESS(4)
FAGEN_TSAN_ACCESS(8)
FAGEN_TSAN_ACCESS(16)
#undef FAGEN_TSAN_ACCESS

FAGEN_TSAN void __tsan_read_range(void* p, unsigned long size) {
  fagen_emu::on_access_hook(p, size, false, __builtin_return_address(0));
}
FAGEN_TSAN void __tsan_write_range(void* p, unsigned long size) {
  fagen_emu::on_access_hook(p, size, true, __builtin_return_address(0));
}
FAGEN_TSAN void __tsan_init() {}
FAGEN_TSAN void __tsan_func_entry(void*) {}
FAGEN_TSAN void __tsan_func_exit() {}
FAGEN_TSAN void __tsan_vptr_update(void**, void*) {}
FAGEN_TSAN void __tsan_vptr_read(void**) {}
FAGEN_TSAN void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
FAGEN_TSAN void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

#define FAGEN_TSAN_ATOMICS(bits)                                                                       \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_load(const volatile a##bits* p, int) {                      \
    atomic_seen(p, false);                                                                             \
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);                                                       \
  }                                                                                                    \
  FAGEN_TSAN void __tsan_atomic##bits##_store(volatile a##bits* p, a##bits v, int) {                   \
    atomic_seen(p, true);                                                                              \
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);                                                          \
  }                                                                                                    \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_exchange(volatile a##bits* p, a##bits v, int) {             \
    atomic_seen(p, true);                                                                              \
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);                                                \
  }                                                                                                    \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_fetch_add(volatile a##bits* p, a##bits v, int) {            \
    atomic_seen(p, true);                                                                              \
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);                                                 \
  }                                                                                                    \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_fetch_sub(volatile a##bits* p, a##bits v, int) {            \
    atomic_seen(p, true);                                                                              \
    return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);                                                 \
  }                                                                                                    \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_fetch_and(volatile a##bits* p, a##bits v, int) {            \
    atomic_seen(p, true);                                                                              \
    return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);                                                 \
  }                                                                                                    \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_fetch_or(volatile a##bits* p, a##bits v, int) {             \
    atomic_seen(p, true);                                                                              \
    return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);                                                  \
  }                                                                                                    \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_fetch_xor(volatile a##bits* p, a##bits v, int) {            \
    atomic_seen(p, true);                                                                              \
    return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST);                                                 \
  }                                                                                                    \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_fetch_nand(volatile a##bits* p, a##bits v, int) {           \
    atomic_seen(p, true);                                                                              \
    return __atomic_fetch_nand(p, v, __ATOMIC_SEQ_CST);                                                \
  }                                                                                                    \
  FAGEN_TSAN int __tsan_atomic##bits##_compare_exchange_strong(volatile a##bits* p, a##bits* expected, \
                                                               a##bits desired, int, int) {            \
    atomic_seen(p, true);                                                                              \
    return __atomic_compare_exchange_n(p, expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                                    \
  FAGEN_TSAN int __tsan_atomic##bits##_compare_exchange_weak(volatile a##bits* p, a##bits* expected,   \
                                                             a##bits desired, int, int) {              \
    atomic_seen(p, true);                                                                              \
    return __atomic_compare_exchange_n(p, expected, desired, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                                    \
  FAGEN_TSAN a##bits __tsan_atomic##bits##_compare_exchange_val(volatile a##bits* p, a##bits expected,  \
                                                                a##bits desired, int, int) {           \
    atomic_seen(p, true);                                                                              \
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);     \
    return expected;                                                                                   \
  }

FAGEN_TSAN_ATOMICS(8)
FAGEN_TSAN_ATOMICS(16)
FAGEN_TSAN_ATOMICS(32)
FAGEN_TSAN_ATOMICS(64)
#undef FAGEN_TSAN_ATOMICS
