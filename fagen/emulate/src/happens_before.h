// Happens-before between the threads of one block, for racecheck: vector clocks
// (FastTrack's: Flanagan and Freund, PLDI 2009) and the sync objects that carry them.
//
// Each thread has a clock, ticked at each of its release points; its vector
// says, per thread, the latest clock of that thread it has acquired. An access
// stamped (u, clock) happens before thread t's next access iff clock <= t's
// vector[u] (or u is t). Besides the threads, the vectors have one component
// per asynchronous agent: the TMA loads completing one mbarrier write as that
// barrier's agent, so a waiter on one barrier's phase learns of those bytes only.
//
// __syncthreads is the common case and would cost a join of every vector into
// every other (threads^2): instead it starts a new *generation*, and an access
// stamped with an older generation happens before everything (a block barrier
// orders all before it with all after it). Every thread's clock ticks at the
// barrier, so what a vector learnt before it never covers an access after it.
// Generations count per OS thread across blocks: a stamp left by an earlier
// block is an older generation.
#pragma once

#include "runtime_internal.h"

#include <unordered_map>
#include <vector>

namespace fagen_emu {

using Clock = uint32_t;

// Async agents: components past the threads', one per mbarrier that TMA loads complete
// (shared, modulo, past this many barriers: over-ordering, never a false report).
constexpr unsigned kAsyncAgents = 64;

class HappensBefore {
 public:
  void block_start(unsigned threads);

  unsigned threads() const { return threads_; }
  uint32_t generation() const { return generation_; }
  uint32_t first_generation() const { return first_generation_; }
  Clock now(unsigned t) const { return clocks_[t * width_ + t]; }

  // Whether an access by `u` (a thread or an agent) stamped (generation, clock)
  // happens before thread t's next access.
  bool before(unsigned u, uint32_t generation, Clock clock, unsigned t) const {
    return generation != generation_ || u == t || clock <= clocks_[t * width_ + u];
  }

  // -- edges ----------------------------------------------------------------------------
  void block_barrier();                            // __syncthreads
  void warp_sync(unsigned warp, unsigned mask);    // __syncwarp(mask): the lanes join
  void mbarrier_release(const void* bar, unsigned t);  // arrive, a thread's complete_tx
  void mbarrier_phase_completed(const void* bar);
  void mbarrier_acquire(const void* bar, unsigned t);  // a wait that saw the phase complete
  void named_release(unsigned id, unsigned t);     // bar.arrive / bar.sync arrival
  // The use of barrier `id` completed: the threads in `waiting` (per warp) were in bar.sync.
  void named_completed(unsigned id, const unsigned* waiting, unsigned warps);

  // -- asynchronous copies ------------------------------------------------------------
  // A TMA load's issue: the vector it will release with its bytes (t's, before t ticks).
  std::vector<Clock> issue_async(unsigned t);
  // The load landed: a fresh stamp of `bar`'s agent, released into its phase with `issued`.
  // Returns the agent component and sets `clock` to the stamp the bytes carry.
  unsigned land_async(const void* bar, const std::vector<Clock>& issued, Clock& clock);

  // -- fence.proxy.async ----------------------------------------------------------------
  void proxy_fence(unsigned t);
  // Whether thread u ran fence.proxy.async after its write at `clock` (same generation
  // or older), and that fence happens before thread t's next access.
  bool fenced_before(unsigned u, Clock clock, unsigned t) const;

 private:
  struct Fence {
    uint32_t generation;
    Clock clock;
  };
  struct MbarrierClocks {
    std::vector<Clock> current;    // released into the phase in progress
    std::vector<Clock> completed;  // the last completed phase's
    int agent = -1;
  };
  Clock* row(unsigned t) { return &clocks_[t * width_]; }
  void tick(unsigned t) { clocks_[t * width_ + t] += 1; }
  void join_into(std::vector<Clock>& into, const Clock* from) const;
  void join_row(unsigned t, const std::vector<Clock>& from);
  MbarrierClocks& mbarrier(const void* bar);

  unsigned threads_ = 0;
  unsigned width_ = 0;   // threads_ + kAsyncAgents
  uint32_t generation_ = 0;
  uint32_t first_generation_ = 0;
  std::vector<Clock> clocks_;  // [thread][width_]
  Clock agent_clock_[kAsyncAgents] = {};
  unsigned agents_used_ = 0;
  std::unordered_map<uintptr_t, MbarrierClocks> mbarriers_;
  std::vector<Clock> named_[16];
  std::vector<std::vector<Fence>> fences_;  // per thread, in program order
  std::vector<Clock> scratch_;
};

}  // namespace fagen_emu
