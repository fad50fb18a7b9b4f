// The global semaphore twins (fagen_emulate/semaphore.h, templates/include/fagen/semaphore.cuh):
// a counter in global memory that blocks take turns on.
//
// A wait whose value is not there blocks the calling fiber, like an mbarrier wait, and records the
// counter and the value on the fiber. Its block's scheduler re-reads the waits at the end of a pass
// when some arrive came since they were last read (Residency::arrivals counts the launch's arrives),
// and parks the block when no thread can run (block_residency.cpp). The counter is read and
// incremented atomically: blocks on other OS threads arrive concurrently.
//
// Counters only increase (red.add of 1), so a value past the awaited one can never come back: the
// wait is a fault at once, not a deadlock later.
#include "runtime_internal.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>

namespace fagen_emu {
namespace {

const char kWaitOp[] = "semaphore wait";

std::string hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

int load(const int* sem) { return __atomic_load_n(sem, __ATOMIC_ACQUIRE); }

// The kernel's parameter codes ("p:i32,pc:f16,i32"), from the module's fagen_signature_<name>.
std::vector<std::string> parameter_codes(const KernelEntry& entry) {
  std::vector<std::string> codes;
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(entry.kernel), &info) || !info.dli_fname) return codes;
  void* module = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  if (!module) return codes;
  using Signature = const char* (*)();
  const auto signature =
      reinterpret_cast<Signature>(dlsym(module, (std::string("fagen_signature_") + entry.name).c_str()));
  if (signature) {
    const std::string text = signature();
    for (std::size_t at = 0; at <= text.size();) {
      const std::size_t comma = std::min(text.find(',', at), text.size());
      codes.push_back(text.substr(at, comma - at));
      at = comma + 1;
    }
  }
  dlclose(module);
  return codes;
}

// "argument 0 + 8 bytes (0x7f...)": the semaphore as an offset into the pointer argument at or
// below it (a kernel reaches global memory only through its arguments), else its address.
std::string describe_semaphore(const LaunchState& launch, const int* sem) {
  const auto address = reinterpret_cast<uintptr_t>(sem);
  const std::vector<std::string> codes = parameter_codes(launch.entry);
  int best = -1;
  uintptr_t base = 0;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    if (codes[i].rfind("p:", 0) != 0 && codes[i].rfind("pc:", 0) != 0) continue;
    const auto pointer = reinterpret_cast<uintptr_t>(*static_cast<void**>(launch.args[i]));
    if (pointer && pointer <= address && (best < 0 || pointer > base)) {
      best = static_cast<int>(i);
      base = pointer;
    }
  }
  if (best < 0) return hex(address);
  return "argument " + std::to_string(best) + " + " + std::to_string(address - base) + " bytes (" + hex(address) + ")";
}

std::string past_value(const LaunchState& launch, const int* sem, int seen, int value) {
  return "semaphore at " + describe_semaphore(launch, sem) + " is " + std::to_string(seen) + ", past the awaited " +
         std::to_string(value) + ": a counter only increases, so this wait can never return (a block arrived "
         "out of turn, or the wait names a turn already taken)";
}

void check_semaphore(const int* sem, const char* op, Site site) {
  const auto address = reinterpret_cast<uintptr_t>(sem);
  if (!sem || address % alignof(int) != 0) {
    fail(site, "%s on %s: a semaphore is a 4-byte aligned int in global memory", op, hex(address).c_str());
  }
  const StaticShared statics = static_shared_of(current_fiber->block->launch->entry.kernel);
  const bool in_static = statics.data && address - reinterpret_cast<uintptr_t>(statics.data) < statics.size;
  if (in_static || address - reinterpret_cast<uintptr_t>(dynamic_shared_base()) < kMaxDynamicSharedBytes) {
    fail(site, "%s on %s, which is shared memory: a semaphore orders blocks, so it lives in global memory", op,
         hex(address).c_str());
  }
}

}  // namespace

// -- the twins ---------------------------------------------------------------------------

// Until *sem == value.
void semaphore_wait_eq(const int* sem, int value, Site site) {
  check_semaphore(sem, "semaphore_wait_eq", site);
  Fiber& self = *current_fiber;
  BlockRun& block = *self.block;
  // The epoch first: an arrive after this read bumps it, so the block re-reads the value then.
  const uint64_t epoch = block.launch->residency.arrivals.load();
  const int seen = load(sem);
  if (seen == value) {
    semaphore_acquired(block, sem);
    return;
  }
  if (seen > value) fail(site, "%s", past_value(*block.launch, sem, seen, value).c_str());
  self.semaphore = sem;
  self.semaphore_value = value;
  if (block.semaphore_waiters++ == 0 || epoch < block.semaphore_epoch) block.semaphore_epoch = epoch;
  block_current(kWaitOp, site);  // runnable again once the scheduler reads the value there (and acquired)
}


void semaphore_arrive(int* sem, Site site) {
  check_semaphore(sem, "semaphore_arrive", site);
  // The release orders the caller's completed writes: an async bulk write in flight is not among
  // them, so the next block in turn could add before it lands.
  if (const std::string pending = bulk_writes_in_flight(); !pending.empty()) {
    fail(site, "semaphore_arrive while %s has not completed (cp.async.bulk.wait_group, without .read, "
               "retires it): the release does not order its writes", pending.c_str());
  }
  semaphore_release(sem);  // the increment, ordered with racecheck's clocks
  semaphore_arrived(*current_fiber->block->launch);
}

// -- for the scheduler and the residency ---------------------------------------------------

bool recheck_semaphore_waits(BlockRun& block) {
  Residency& residency = block.launch->residency;
  const uint64_t epoch = residency.arrivals.load();
  if (epoch == block.semaphore_epoch) return false;
  block.semaphore_epoch = epoch;
  bool released = false;
  for (unsigned id = 0; id < block.thread_count; ++id) {
    Fiber& fiber = block.fibers[id];
    if (fiber.state != FiberState::blocked || fiber.blocked_in != kWaitOp) continue;
    const int seen = load(fiber.semaphore);
    if (seen < fiber.semaphore_value) continue;
    if (seen > fiber.semaphore_value) {
      block.failed = true;
      block.error = describe_thread(fiber) + past_value(*block.launch, fiber.semaphore, seen, fiber.semaphore_value) +
                    " (at " + format_site(fiber.blocked_site) + ")";
      return true;
    }
    semaphore_acquired(block, fiber.semaphore);
    fiber.state = FiberState::runnable;
    fiber.blocked_in = nullptr;
    fiber.semaphore = nullptr;
    block.semaphore_waiters -= 1;
    released = true;
  }
  if (released) block.idle_yields = 0;
  return released;
}

bool semaphore_waits_ready(const BlockRun& block) {
  for (unsigned id = 0; id < block.thread_count; ++id) {
    const Fiber& fiber = block.fibers[id];
    if (fiber.state == FiberState::blocked && fiber.blocked_in == kWaitOp &&
        load(fiber.semaphore) >= fiber.semaphore_value)
      return true;
  }
  return false;
}

std::string describe_semaphore_waits(const BlockRun& block) {
  std::string text;
  for (unsigned id = 0; id < block.thread_count; ++id) {
    const Fiber& fiber = block.fibers[id];
    if (fiber.state != FiberState::blocked || fiber.blocked_in != kWaitOp) continue;
    text += " Thread " + std::to_string(id) + " waits in " + kWaitOp + " at " + format_site(fiber.blocked_site) +
            " for the semaphore at " + describe_semaphore(*block.launch, fiber.semaphore) + " to equal " +
            std::to_string(fiber.semaphore_value) + " (it is " + std::to_string(load(fiber.semaphore)) + ").";
  }
  return text;
}

}  // namespace fagen_emu
