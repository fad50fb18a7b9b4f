// Running one thread block: its threads as fibers on this OS thread, the
// block barrier, the warp rendezvous, and the messages that name a fault.
//
// Scheduling (FAGEN_EMULATE_SCHEDULE): forward / reverse resume runnable
// fibers in thread order (or the reverse order); a fiber runs until it blocks
// at a barrier or warp-collective op, or exits, so the warps of a block
// advance in lockstep, at most about one collective apart. warp-serial /
// warp-serial-reverse run one warp until all its lanes wait at the block
// barrier, then the next: a warp runs a whole barrier interval ahead of the
// others, which is what exposes a missing barrier between a read of a shared
// tile and its refill. The last thread to arrive at a rendezvous completes it and
// keeps running; the others become runnable. A thread therefore runs ahead
// of the threads after it up to its next synchronisation point, which is what
// makes a missing barrier show up as wrong data. Faults are detected at the
// moment they become certain (a thread exits or waits elsewhere while others
// wait for it), so nothing ever hangs; the deadlock check after a pass that
// ran nothing is the backstop.
#include "runtime_internal.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstring>
#include <new>

namespace fagen_emu {

__thread Fiber* current_fiber = nullptr;
__thread const ThreadCoords* current_thread FAGEN_EMU_RUNTIME_API = nullptr;
__thread BlockCoords current_block FAGEN_EMU_RUNTIME_API;

namespace {

const char kBarrierOp[] = "__syncthreads";

bool same_site(Site a, Site b) {
  return a.line == b.line && (a.file == b.file || (a.file && b.file && std::strcmp(a.file, b.file) == 0));
}

Worker& worker_of(const Fiber& fiber) { return *fiber.block->worker; }

void switch_to_scheduler(Fiber& fiber, bool finished) {
  Worker& worker = worker_of(fiber);
  switch_context(fiber.context, worker.scheduler_context, worker.scheduler_stack, finished);
}

std::vector<unsigned> threads_at_barrier(const BlockRun& block) {
  std::vector<unsigned> ids;
  for (unsigned id = 0; id < block.thread_count; ++id)
    if (block.fibers[id].state == FiberState::blocked && block.fibers[id].blocked_in == kBarrierOp)
      ids.push_back(id);
  return ids;
}

std::string describe_deadlock(const BlockRun& block) {
  return "deadlock: no thread can make progress." + describe_blocked_threads(block);
}

void fiber_main(void* argument) {
  Fiber& fiber = *static_cast<Fiber*>(argument);
  Worker& worker = worker_of(fiber);
  const StackBounds from = fiber_started();
  if (from.bottom) worker.scheduler_stack = from;
  BlockRun& block = *fiber.block;
  block.launch->entry.thunk(block.launch->entry.kernel, block.launch->args);

  // The thread has returned from the kernel.
  land_all_copies(fiber);
  warpgroup_check_exit(fiber);
  const unsigned lane = fiber.coords.lane, warp = fiber.coords.warp;
  if (const PendingCollective* p = block.warps[warp].awaiting(lane)) {
    fail_current("lane " + std::to_string(lane) + " of warp " + std::to_string(warp) +
                 " exited, but lanes " + format_lanes(p->arrived) + " wait for it in " + p->op + " at " +
                 format_site(p->site) + ": a warp-collective op called by part of the warp");
  }
  if (block.barrier_arrived > 0) {
    fail_current("thread " + std::to_string(fiber.coords.linear) +
                 " exited without reaching the __syncthreads at " + format_site(block.barrier_site) +
                 " where threads " + format_threads(threads_at_barrier(block)) +
                 " wait: a barrier must be reached by every thread of the block");
  }
  fiber.state = FiberState::exited;
  block.live -= 1;
  block.idle_yields = 0;
  block.live_lanes[warp] &= ~(1u << lane);
  if (block.first_exited < 0) block.first_exited = static_cast<int>(fiber.coords.linear);
  switch_to_scheduler(fiber, /*finished=*/true);
  __builtin_unreachable();
}

void resume(Worker& worker, Fiber& fiber) {
  current_fiber = &fiber;
  current_thread = &fiber.coords;
  fiber.block->running = &fiber;
  switch_context(worker.scheduler_context, fiber.context, StackBounds{fiber.stack, fiber.stack_size},
                 /*from_finished=*/false);
  current_fiber = nullptr;
  current_thread = nullptr;
}

}  // namespace

// -- formatting -----------------------------------------------------------------

std::string describe_block(const BlockRun& block) {
  return "block (" + std::to_string(block.block_idx.x) + "," + std::to_string(block.block_idx.y) + "," +
         std::to_string(block.block_idx.z) + ")";
}

std::string describe_blocked_threads(const BlockRun& block) {
  std::string message;
  if (block.barrier_arrived > 0) {
    message += " Threads " + format_threads(threads_at_barrier(block)) + " wait at __syncthreads at " +
               format_site(block.barrier_site) + ".";
  }
  for (unsigned warp = 0; warp < block.warp_count; ++warp) {
    const WarpState& state = block.warps[warp];
    for (unsigned i = 0; i < state.count; ++i) {
      const PendingCollective& p = state.pending[i];
      message += " Warp " + std::to_string(warp) + ": lanes " + format_lanes(p.arrived) + " wait in " + p.op +
                 " at " + format_site(p.site) + " for lanes " + format_lanes(p.mask & ~p.arrived) + ".";
    }
  }
  message += describe_mbarrier_waits(block) + describe_named_barrier_waits(block) + describe_warpgroup_waits(block);
  return message;
}

std::string describe_thread(const Fiber& fiber) {
  const uint3 t = fiber.coords.thread_idx;
  return "thread " + std::to_string(fiber.coords.linear) + " (threadIdx (" + std::to_string(t.x) + "," +
         std::to_string(t.y) + "," + std::to_string(t.z) + "), warp " + std::to_string(fiber.coords.warp) +
         ", lane " + std::to_string(fiber.coords.lane) + "): ";
}

std::string format_site(Site site) {
  if (!site.file) return "<unknown>";
  const char* base = std::strrchr(site.file, '/');
  return std::string(base ? base + 1 : site.file) + ":" + std::to_string(site.line);
}

std::string format_threads(const std::vector<unsigned>& ids) {
  if (ids.empty()) return "(none)";
  std::string text;
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!text.empty()) text += ",";
    text += std::to_string(ids[i]);
    if (j > i) text += "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return text;
}

std::string format_lanes(unsigned lanes) {
  std::vector<unsigned> ids;
  for (unsigned lane = 0; lane < 32; ++lane)
    if (lanes >> lane & 1u) ids.push_back(lane);
  return format_threads(ids);
}

// -- faults -----------------------------------------------------------------------

void fail_current(const std::string& message) {
  Fiber& fiber = *current_fiber;
  BlockRun& block = *fiber.block;
  block.failed = true;
  block.error = describe_thread(fiber) + message;
  switch_to_scheduler(fiber, /*finished=*/true);
  __builtin_unreachable();
}

void fail_race(const std::string& message) {
  Fiber& fiber = *current_fiber;
  fiber.block->failed = true;
  fiber.block->error = message;
  switch_to_scheduler(fiber, /*finished=*/true);
  __builtin_unreachable();
}

void fail(Site site, const char* format, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  fail_current(std::string(buffer) + " (at " + format_site(site) + ")");
}

void assert_failed(const char* expression, const char* file, int line) {
  fail_current("assertion `" + std::string(expression) + "` failed at " + format_site({file, line}));
}

void yield_to_block() {
  Fiber& fiber = *current_fiber;
  // Threads that only spin (a flag loop with __nanosleep) while nothing else
  // completes would never end: call that a livelock rather than hang.
  constexpr uint64_t kMaxIdleYields = uint64_t{1} << 20;
  if (++fiber.block->idle_yields > kMaxIdleYields) {
    fail_current("livelock: threads keep spinning in __nanosleep while no barrier or warp-collective op "
                 "completes and no thread exits");
  }
  fiber.block->yielded = true;
  switch_to_scheduler(fiber, /*finished=*/false);
}

// -- rendezvous ---------------------------------------------------------------------

void block_current(const char* op, Site site) {
  Fiber& fiber = *current_fiber;
  fiber.state = FiberState::blocked;
  fiber.blocked_in = op;
  fiber.blocked_site = site;
  switch_to_scheduler(fiber, /*finished=*/false);
}

void warp_collective(const char* op, unsigned mask, const void* in, void* out, CollectiveCompute compute,
                     Site site) {
  Fiber& self = *current_fiber;
  BlockRun& block = *self.block;
  const unsigned lane = self.coords.lane, warp = self.coords.warp, bit = 1u << lane;
  WarpState& state = block.warps[warp];
  if (!(mask & bit)) {
    fail(site, "%s with mask 0x%08x, which does not include the calling lane %u", op, mask, lane);
  }
  if (const unsigned gone = mask & ~block.live_lanes[warp]) {
    fail(site, "%s with mask 0x%08x names lanes %s of warp %u, which have exited or do not exist "
               "(the block has %u threads): a warp-collective op called by part of the warp",
         op, mask, format_lanes(gone).c_str(), warp, block.thread_count);
  }
  if (const unsigned stuck = block.barrier_lanes[warp] & mask) {
    fail(site, "lane %u calls %s, but lanes %s of its warp wait at __syncthreads at %s: a warp-collective "
               "op called by part of the warp",
         lane, op, format_lanes(stuck).c_str(), format_site(block.barrier_site).c_str());
  }
  unsigned index = state.count;
  for (unsigned i = 0; i < state.count; ++i) {
    const PendingCollective& p = state.pending[i];
    if (p.op == op && p.mask == mask && same_site(p.site, site)) {
      index = i;
    } else if (const unsigned stuck = p.arrived & mask) {
      // Lanes this op needs are waiting in another one: neither can complete.
      fail(site, "lane %u calls %s (mask 0x%08x) while lanes %s of its warp wait in %s at %s (mask 0x%08x): "
                 "the warp diverged at a warp-collective op",
           lane, op, mask, format_lanes(stuck).c_str(), p.op, format_site(p.site).c_str(), p.mask);
    }
  }
  if (index == state.count) {
    state.pending[state.count++] = PendingCollective{op, site, mask, 0u, compute};
  }
  PendingCollective& group = state.pending[index];
  self.collective_in = in;
  self.collective_out = out;
  group.arrived |= bit;
  if (group.arrived != mask) {
    block_current(op, site);
    return;
  }
  // Last to arrive: compute every lane's result, release the others.
  WarpRendezvous rendezvous;
  rendezvous.op = op;
  rendezvous.site = site;
  rendezvous.mask = mask;
  for (unsigned other = 0; other < 32; ++other) {
    if (!(mask >> other & 1u)) continue;
    const Fiber& fiber = block.fibers[warp * 32 + other];
    rendezvous.in[other] = fiber.collective_in;
    rendezvous.out[other] = fiber.collective_out;
  }
  state.pending[index] = state.pending[--state.count];
  block.idle_yields = 0;
  compute(rendezvous);
  instrument_warp_sync(block, warp, mask, /*collective=*/op != kSyncWarpOp);
  for (unsigned other = 0; other < 32; ++other) {
    if (other == lane || !(mask >> other & 1u)) continue;
    Fiber& fiber = block.fibers[warp * 32 + other];
    fiber.state = FiberState::runnable;
    fiber.blocked_in = nullptr;
  }
}

int sync_threads_count(int predicate, Site site) {
  Fiber& self = *current_fiber;
  BlockRun& block = *self.block;
  const unsigned lane = self.coords.lane, warp = self.coords.warp;
  warpgroup_check_barrier(site);
  if (const PendingCollective* p = block.warps[warp].awaiting(lane)) {
    fail(site, "__syncthreads reached while lanes %s of warp %u wait for this lane in %s at %s: a "
               "warp-collective op called by part of the warp",
         format_lanes(p->arrived).c_str(), warp, p->op, format_site(p->site).c_str());
  }
  check_named_barrier_zero_idle(site);
  if (block.first_exited >= 0) {
    std::vector<unsigned> exited;
    for (unsigned id = 0; id < block.thread_count; ++id)
      if (block.fibers[id].state == FiberState::exited) exited.push_back(id);
    fail(site, "__syncthreads reached after threads %s exited: a barrier must be reached by every thread "
               "of the block", format_threads(exited).c_str());
  }
  if (block.barrier_arrived == 0) {
    block.barrier_site = site;
    block.barrier_count = 0;
  } else if (!same_site(block.barrier_site, site)) {
    fail(site, "divergent barriers: this thread reached __syncthreads here while threads %s wait at the "
               "__syncthreads at %s",
         format_threads(threads_at_barrier(block)).c_str(), format_site(block.barrier_site).c_str());
  }
  block.barrier_arrived += 1;
  block.barrier_count += predicate != 0;
  if (block.barrier_arrived < block.live) {
    block.barrier_lanes[warp] |= 1u << lane;
    block_current(kBarrierOp, site);
    return self.barrier_result;
  }
  const int count = block.barrier_count;
  instrument_barrier(block);
  for (unsigned w = 0; w < block.warp_count; ++w) {
    for (unsigned lanes = block.barrier_lanes[w]; lanes; lanes &= lanes - 1) {
      Fiber& fiber = block.fibers[w * 32 + static_cast<unsigned>(__builtin_ctz(lanes))];
      fiber.state = FiberState::runnable;
      fiber.blocked_in = nullptr;
      fiber.barrier_result = count;
    }
    block.barrier_lanes[w] = 0;
  }
  block.barrier_arrived = 0;
  block.idle_yields = 0;
  block.barriers_completed += 1;
  if (block.launch->config.schedule >= kScheduleWarpSerial) {
    // Warp-serial: the next phase starts from the first warp in order, not from
    // the thread that happened to arrive last (the reordering schedules: the
    // scheduler picks who runs next).
    switch_to_scheduler(self, /*finished=*/false);
  }
  return count;
}

void sync_threads(Site site) { sync_threads_count(0, site); }

unsigned live_lanes() {
  const Fiber& self = *current_fiber;
  return self.block->live_lanes[self.coords.warp];
}

void check_dynamic_shared_range(const void* address, std::size_t bytes, const char* what, Site site) {
  const auto* base = dynamic_shared_base();
  const auto* p = static_cast<const unsigned char*>(address);
  if (p < base || p >= base + kMaxDynamicSharedBytes) return;
  const uint64_t size = current_fiber->block->launch->config.shared_mem_bytes;
  const auto offset = static_cast<uint64_t>(p - base);
  if (offset + bytes > size) {
    fail(site, "%s touches dynamic shared memory bytes [%llu, %llu), past the %llu bytes the launch has", what,
         static_cast<unsigned long long>(offset), static_cast<unsigned long long>(offset + bytes),
         static_cast<unsigned long long>(size));
  }
}

// -- one block -------------------------------------------------------------------------

void Worker::ensure_fibers(unsigned count, std::size_t wanted_stack_size) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t stride = wanted_stack_size + page;  // a guard page below each stack
  if (fibers.size() >= count && stack_size == wanted_stack_size) return;
  if (stack_region) {
    // Under ASan: frames that never returned (a finished fiber's last switch) leave poisoned stack
    // redzones in the shadow, which a later mapping at these addresses (a kernel module's .so
    // loaded in the checked runner) would inherit as false stack-buffer-overflows.
    unpoison_stack(stack_region, region_bytes);
    munmap(stack_region, region_bytes);
  }
  stack_region = nullptr;
  region_bytes = stride * count;
  void* region = mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
  if (region == MAP_FAILED) throw std::bad_alloc();
  stack_region = static_cast<char*>(region);
  stack_size = wanted_stack_size;
  fibers.resize(count);
  for (unsigned i = 0; i < count; ++i) {
    char* guard = stack_region + i * stride;
    mprotect(guard, page, PROT_NONE);  // a stack overflow faults instead of corrupting a neighbour
    fibers[i].stack = guard + page;
    fibers[i].stack_size = wanted_stack_size;
  }
}

namespace {

// The end of a scheduling pass. Threads blocked in semaphore waits are re-checked if some block
// arrived since (they become runnable, or the block fails on a value past theirs). A pass that ran
// nothing while threads wait on semaphores parks the block until an arrive (block_residency.cpp);
// with none waiting, nothing can ever run again: a deadlock within the block.
void mark_deadlock_unless(bool ran, BlockRun& block) {
  if (block.failed) return;
  if (block.semaphore_waiters > 0 && recheck_semaphore_waits(block)) return;
  if (ran) return;
  if (block.semaphore_waiters > 0) {
    if (!park_block(block) && !block.failed) {
      block.failed = true;
      block.error = "abandoned while parked on a semaphore: the launch failed elsewhere";
    }
    return;
  }
  block.failed = true;
  block.error = describe_deadlock(block);
}

// forward / reverse: pass over the threads in order, each running until it blocks.
void run_thread_order(Worker& worker, BlockRun& block, bool reverse) {
  const unsigned n = block.thread_count;
  while (block.live > 0 && !block.failed) {
    bool ran = false;
    for (unsigned k = 0; k < n && !block.failed; ++k) {
      Fiber& fiber = block.fibers[reverse ? n - 1 - k : k];
      if (fiber.state != FiberState::runnable) continue;
      ran = true;
      resume(worker, fiber);
    }
    mark_deadlock_unless(ran, block);
  }
}

// Runs warp `w` until none of its lanes can go on (they wait at the block barrier,
// or exited), the barrier completes, or a lane yields in __nanosleep (so that a
// warp spinning on another one lets it run).
bool run_one_warp(Worker& worker, BlockRun& block, unsigned w, uint64_t phase) {
  bool ran = false;
  const unsigned first = w * 32, last = std::min(block.thread_count, first + 32);
  for (bool progress = true; progress && !block.failed;) {
    progress = false;
    block.yielded = false;
    for (unsigned id = first; id < last && !block.failed; ++id) {
      Fiber& fiber = block.fibers[id];
      if (fiber.state != FiberState::runnable) continue;
      progress = ran = true;
      resume(worker, fiber);
      if (block.barriers_completed != phase) return true;
    }
    if (block.yielded) break;
  }
  return ran;
}

// warp-serial / warp-serial-reverse: one warp at a time, each up to the next
// block barrier; after a barrier, from the first warp in order again.
void run_warp_serial(Worker& worker, BlockRun& block, bool reverse) {
  const unsigned warps = block.warp_count;
  while (block.live > 0 && !block.failed) {
    bool ran = false;
    const uint64_t phase = block.barriers_completed;
    for (unsigned k = 0; k < warps && !block.failed && block.barriers_completed == phase; ++k)
      ran |= run_one_warp(worker, block, reverse ? warps - 1 - k : k, phase);
    mark_deadlock_unless(ran, block);
  }
}

}  // namespace

// -- for the reordering schedules (schedule_orders.cpp) and the sync twins ------------------

void resume_fiber(Worker& worker, Fiber& fiber) { resume(worker, fiber); }
void fail_deadlock_unless(bool ran, BlockRun& block) { mark_deadlock_unless(ran, block); }

void reschedule_after_release() {
  Fiber& fiber = *current_fiber;
  if (schedule_reorders(fiber.block->launch->config.schedule)) switch_to_scheduler(fiber, /*finished=*/false);
}

bool run_block(Worker& worker, LaunchState& launch, uint64_t linear_block, uint64_t dispatch) {
  const LaunchConfig& config = launch.config;
  BlockRun block;
  block.launch = &launch;
  block.worker = &worker;
  block.linear_block = linear_block;
  block.dispatch = dispatch;
  block.block_idx = uint3{static_cast<unsigned>(linear_block % config.grid[0]),
                          static_cast<unsigned>(linear_block / config.grid[0] % config.grid[1]),
                          static_cast<unsigned>(linear_block / config.grid[0] / config.grid[1])};
  block.thread_count = config.block[0] * config.block[1] * config.block[2];
  block.warp_count = (block.thread_count + 31) / 32;

  worker.ensure_fibers(block.thread_count, launch.stack_size);
  // Under ASan: frames that never return (a finished fiber's last switch, an
  // abandoned block) leave poisoned redzones behind on the reused stacks.
  for (unsigned id = 0; id < block.thread_count; ++id) unpoison_stack(worker.fibers[id].stack, launch.stack_size);
  poison_block_shared_memory(launch.entry.kernel, config.shared_mem_bytes);
  current_block.block_idx = block.block_idx;
  current_block.block_dim = uint3{config.block[0], config.block[1], config.block[2]};
  current_block.grid_dim = uint3{config.grid[0], config.grid[1], config.grid[2]};

  block.fibers = worker.fibers.data();
  for (unsigned id = 0; id < block.thread_count; ++id) {
    Fiber& fiber = block.fibers[id];
    fiber.coords.thread_idx = uint3{id % config.block[0], id / config.block[0] % config.block[1],
                                    id / config.block[0] / config.block[1]};
    fiber.coords.linear = id;
    fiber.coords.warp = id / 32;
    fiber.coords.lane = id % 32;
    fiber.state = FiberState::runnable;
    fiber.blocked_in = nullptr;
    fiber.committed_groups = 0;
    fiber.copies.clear();
    fiber.semaphore = nullptr;
    fiber.block = &block;
    prepare_context(fiber.context, fiber.stack, fiber.stack_size, &fiber_main, &fiber);
    block.live_lanes[fiber.coords.warp] |= 1u << fiber.coords.lane;
  }
  block.live = block.thread_count;

  instrument_block_start(block);
  mbarrier_block_start();
  named_barrier_block_start();
  tma_block_start();
  if (schedule_reorders(config.schedule)) {
    run_reordering_schedule(worker, block);
  } else if (config.schedule >= kScheduleWarpSerial) {
    run_warp_serial(worker, block, config.schedule == kScheduleWarpSerialReverse);
  } else {
    run_thread_order(worker, block, config.schedule == kScheduleReverse);
  }
  if (!block.failed) {
    const std::string unfinished = tma_block_end();
    if (!unfinished.empty()) {
      block.failed = true;
      block.error = unfinished;
    }
  }
  instrument_block_end(block);
  if (block.failed) {
    launch.record_error(std::string(launch.entry.name) + ": " + describe_block(block) + ": " + block.error);
    return false;
  }
  return true;
}

}  // namespace fagen_emu
