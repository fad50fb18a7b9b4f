// Resident blocks: how the launch's workers (OS threads) take blocks, how a block that waits on a
// semaphore another block must advance lets the others run, and when that can never happen.
//
// FAGEN_EMULATE_THREADS=N workers hold at most N blocks at once, as N SMs would. A block none of
// whose threads can run while some wait on semaphores is *parked*: it keeps its worker (its
// thread-local state, shared memory and fiber stacks stay put: nothing block-specific moves
// between OS threads) until some block arrives on a semaphore, then re-reads its waits.
//
// Parallel interleave (the default): every worker takes the next block as soon as it is free and
// runs it concurrently with the others. A worker stays resident from the launch's start until it
// finds no block left to take (a worker between two blocks is about to run one that may arrive).
// Deadlock: every resident block is parked, each after its last re-read of its waits came after the
// latest arrive (parked_unchanged == resident), and no waited value is there; nothing running can
// arrive any more.
//
// Serial interleave: one token; only its holder runs. The running block keeps it until it exits or
// parks; then it goes to the first parked block (in dispatch order) whose awaited value is there,
// else to a free worker, which takes the next block of the grid. With no free worker and no parked
// block that can go on, or nothing left to dispatch, the resident blocks are deadlocked. Every
// choice depends on the program's own state only, so for a given grid, block order, thread count
// and thread schedule the order of the blocks' global writes is fixed, whatever the OS does.
#include "runtime_internal.h"

#include <algorithm>

namespace fagen_emu {
namespace {

uint64_t linear_block_of(const LaunchState& launch, uint64_t taken) {
  return launch.config.block_order == kBlockOrderReverse ? launch.total_blocks - 1 - taken : taken;
}

bool serial(const LaunchState& launch) { return launch.config.block_interleave == kBlockInterleaveSerial; }

// Under the lock: every resident block is parked and none can go on. Names each one's waits.
void report_deadlock(LaunchState& launch, Residency& r) {
  const uint64_t started = std::min(launch.next_block.load(), launch.total_blocks);
  const uint64_t waiting = launch.total_blocks - started;
  std::string message = std::string(launch.entry.name) + ": deadlock between blocks: every resident block (" +
                        std::to_string(r.parked.size()) + " of them, FAGEN_EMULATE_THREADS=" +
                        std::to_string(r.workers) + ") waits on a semaphore that no block can advance (";
  message += waiting ? std::to_string(waiting) + " blocks not yet started cannot become resident while the waiting "
                       "blocks hold every slot"
                     : "every other block has finished";
  message += ").";
  for (const ParkedBlock& parked : r.parked)
    message += " " + describe_block(*parked.block) + ":" + describe_semaphore_waits(*parked.block) + parked.waits;
  launch.record_error(message);
  r.ended = true;
  r.changed.notify_all();
}

// Under the lock (parallel): called when a block parks and when a worker leaves.
void check_parallel_deadlock(LaunchState& launch, Residency& r) {
  if (r.ended || r.resident == 0 || r.parked_unchanged < r.resident) return;
  for (const ParkedBlock& parked : r.parked) {
    if (semaphore_waits_ready(*parked.block)) {
      // A counter changed without an arrive (a plain store or atomic into it): look again.
      r.arrivals += 1;
      r.parked_unchanged = 0;
      r.changed.notify_all();
      return;
    }
  }
  report_deadlock(launch, r);
}

// Under the lock (serial): the token holder exits or parks; who runs next.
void hand_off(LaunchState& launch, Residency& r) {
  for (const ParkedBlock& parked : r.parked) {
    if (semaphore_waits_ready(*parked.block)) {
      r.token = parked.block->worker->index;
      r.changed.notify_all();
      return;
    }
  }
  if (launch.next_block.load() < launch.total_blocks) {
    for (int w = 0; w < r.workers; ++w) {
      if (!r.busy[static_cast<std::size_t>(w)]) {
        r.token = w;
        r.changed.notify_all();
        return;
      }
    }
  }
  if (r.resident == 0) {
    r.finished = true;
    r.changed.notify_all();
    return;
  }
  report_deadlock(launch, r);
}

void end_launch(Residency& r) {
  std::lock_guard<std::mutex> lock(r.mutex);
  r.ended = true;
  r.changed.notify_all();
}

void run_parallel(Worker& worker, LaunchState& launch) {
  Residency& r = launch.residency;
  while (!launch.failed.load()) {
    const uint64_t taken = launch.next_block.fetch_add(1);
    if (taken >= launch.total_blocks) break;
    if (!run_block(worker, launch, linear_block_of(launch, taken), taken)) {
      end_launch(r);
      return;
    }
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  r.resident -= 1;  // out of blocks: nothing this worker runs can arrive any more
  check_parallel_deadlock(launch, r);
}

void run_serial(Worker& worker, LaunchState& launch) {
  Residency& r = launch.residency;
  const auto me = static_cast<std::size_t>(worker.index);
  std::unique_lock<std::mutex> lock(r.mutex);
  for (;;) {
    r.changed.wait(lock, [&] { return r.ended || r.finished || (r.token == worker.index && !r.busy[me]); });
    if (r.ended || r.finished) return;
    const uint64_t taken = launch.next_block.fetch_add(1);
    r.busy[me] = 1;
    r.resident += 1;
    lock.unlock();
    const bool ok = run_block(worker, launch, linear_block_of(launch, taken), taken);
    lock.lock();
    r.busy[me] = 0;
    r.resident -= 1;
    if (!ok) {
      r.ended = true;
      r.changed.notify_all();
      return;
    }
    hand_off(launch, r);
  }
}

}  // namespace

void start_residency(LaunchState& launch, int workers) {
  Residency& r = launch.residency;
  r.workers = workers;
  // Parallel: every worker is resident from the start, even one the pool has not started yet (it
  // will take a block that may arrive). Serial: a worker is resident while it holds a block.
  r.resident = serial(launch) ? 0 : workers;
  r.busy.assign(static_cast<std::size_t>(workers), 0);
  r.token = 0;
}

void run_blocks(Worker& worker, LaunchState& launch) {
  try {
    if (serial(launch)) {
      run_serial(worker, launch);
    } else {
      run_parallel(worker, launch);
    }
  } catch (...) {
    end_launch(launch.residency);
    throw;
  }
}

bool park_block(BlockRun& block) {
  LaunchState& launch = *block.launch;
  Residency& r = launch.residency;
  const std::string waits = describe_blocked_threads(block);  // its thread-local state: on this OS thread
  std::unique_lock<std::mutex> lock(r.mutex);
  if (r.ended) return false;
  if (!serial(launch) && r.arrivals.load() != block.semaphore_epoch) return true;  // re-read first
  const auto at = std::find_if(r.parked.begin(), r.parked.end(),
                               [&](const ParkedBlock& p) { return p.block->dispatch > block.dispatch; });
  r.parked.insert(at, ParkedBlock{&block, waits});
  bool current = false;  // counted in parked_unchanged
  if (serial(launch)) {
    hand_off(launch, r);
    r.changed.wait(lock, [&] { return r.ended || r.token == block.worker->index; });
  } else {
    r.parked_unchanged += 1;
    current = true;
    check_parallel_deadlock(launch, r);
    r.changed.wait(lock, [&] { return r.ended || r.arrivals.load() != block.semaphore_epoch; });
  }
  r.parked.erase(std::find_if(r.parked.begin(), r.parked.end(),
                              [&](const ParkedBlock& p) { return p.block == &block; }));
  if (current && r.arrivals.load() == block.semaphore_epoch) r.parked_unchanged -= 1;
  // The next pass re-reads every wait, whether or not an arrive changed the epoch (a waited value
  // may have come from a plain store).
  block.semaphore_epoch = ~uint64_t{0};
  return !r.ended;
}

void semaphore_arrived(LaunchState& launch) {
  Residency& r = launch.residency;
  std::lock_guard<std::mutex> lock(r.mutex);
  r.arrivals += 1;
  r.parked_unchanged = 0;
  r.changed.notify_all();
}

}  // namespace fagen_emu
