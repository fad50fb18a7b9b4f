// The reordering schedules (FAGEN_EMULATE_SCHEDULE): orderings of a warp-specialised
// kernel's threads that the hardware may choose and the lockstep schedules never do.
//
// At every scheduling point (a thread blocks, exits, or completes a block barrier, a
// named barrier or an mbarrier phase that releases others) the scheduler picks the
// next runnable thread:
// - producer-first: the first runnable thread of warpgroup 0 (warps 0-3, the
//   producer in FlashAttention-3's layout), else the first runnable one after it;
//   a producer runs as far ahead of its consumers as its barriers let it;
// - consumer-first: the same with warpgroup 0 last: consumers drain every stage
//   before the producer refills one;
// - random: a pseudo-random warp with runnable threads runs them once each, from
//   LaunchConfig::seed and the block's index (so a seed replays a launch whatever
//   the OS threads do).
// A thread that yields in __nanosleep or try_wait lets the threads after it run.
#include "runtime_internal.h"

#include <algorithm>
#include <numeric>

namespace fagen_emu {
namespace {

constexpr unsigned kWarpgroupThreads = 128;

// Thread ids in priority order: warpgroup 0 first, or last.
std::vector<unsigned> priority_order(unsigned threads, bool producer_first) {
  std::vector<unsigned> order(threads);
  std::iota(order.begin(), order.end(), 0u);
  const unsigned producer = std::min(threads, kWarpgroupThreads);
  if (!producer_first) std::rotate(order.begin(), order.begin() + producer, order.end());
  return order;
}

void run_priority(Worker& worker, BlockRun& block, const std::vector<unsigned>& order) {
  while (block.live > 0 && !block.failed) {
    bool ran = false;
    for (std::size_t k = 0; k < order.size() && !block.failed;) {
      Fiber& fiber = block.fibers[order[k]];
      if (fiber.state != FiberState::runnable) {
        ++k;
        continue;
      }
      ran = true;
      block.yielded = false;
      resume_fiber(worker, fiber);
      k = block.yielded ? k + 1 : 0;  // after a yield, the threads behind it; else from the top
    }
    fail_deadlock_unless(ran, block);
  }
}

// splitmix64: a small, well-mixed generator whose stream a seed fixes.
uint64_t next_random(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A random warp with runnable lanes runs them once each, in lane order: the lanes of
// a warp stay together as the emulator's warp-collective rules expect (a warp's lanes
// reach a collective in lockstep), while warps interleave at random.
void run_random(Worker& worker, BlockRun& block) {
  uint64_t state = block.launch->config.seed ^ (block.linear_block * 0xD1B54A32D192ED03ull);
  std::vector<unsigned> warps;
  warps.reserve(block.warp_count);
  while (block.live > 0 && !block.failed) {
    warps.clear();
    for (unsigned w = 0; w < block.warp_count; ++w) {
      const unsigned last = std::min(block.thread_count, 32 * w + 32);
      for (unsigned id = 32 * w; id < last; ++id) {
        if (block.fibers[id].state == FiberState::runnable) {
          warps.push_back(w);
          break;
        }
      }
    }
    fail_deadlock_unless(!warps.empty(), block);  // or parks the block on its semaphore waits
    if (warps.empty()) continue;
    const unsigned w = warps[next_random(state) % warps.size()];
    const unsigned last = std::min(block.thread_count, 32 * w + 32);
    for (unsigned id = 32 * w; id < last && !block.failed; ++id)
      if (block.fibers[id].state == FiberState::runnable) resume_fiber(worker, block.fibers[id]);
  }
}

}  // namespace

bool schedule_reorders(int32_t schedule) { return schedule >= kScheduleProducerFirst; }

void run_reordering_schedule(Worker& worker, BlockRun& block) {
  const int32_t schedule = block.launch->config.schedule;
  if (schedule == kScheduleRandom) {
    run_random(worker, block);
  } else {
    run_priority(worker, block, priority_order(block.thread_count, schedule == kScheduleProducerFirst));
  }
}

}  // namespace fagen_emu
