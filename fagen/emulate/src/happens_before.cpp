// Vector clocks of one block's threads and the sync objects' clocks (happens_before.h).
#include "happens_before.h"

#include <algorithm>

namespace fagen_emu {

void HappensBefore::block_start(unsigned threads) {
  threads_ = threads;
  width_ = threads + kAsyncAgents;
  generation_ += 1;  // every stamp of an earlier block is now an older generation
  first_generation_ = generation_;
  clocks_.assign(static_cast<std::size_t>(threads) * width_, 0);
  for (unsigned t = 0; t < threads; ++t) row(t)[t] = 1;
  std::fill(agent_clock_, agent_clock_ + kAsyncAgents, 0);
  agents_used_ = 0;
  mbarriers_.clear();
  for (std::vector<Clock>& named : named_) named.clear();
  fences_.assign(threads, {});
}

void HappensBefore::join_into(std::vector<Clock>& into, const Clock* from) const {
  if (into.size() < width_) into.resize(width_, 0);
  for (unsigned u = 0; u < width_; ++u) into[u] = std::max(into[u], from[u]);
}

void HappensBefore::join_row(unsigned t, const std::vector<Clock>& from) {
  Clock* mine = row(t);
  const std::size_t n = std::min<std::size_t>(from.size(), width_);
  for (std::size_t u = 0; u < n; ++u) mine[u] = std::max(mine[u], from[u]);
}

void HappensBefore::block_barrier() {
  generation_ += 1;
  for (unsigned t = 0; t < threads_; ++t) tick(t);
}

void HappensBefore::warp_sync(unsigned warp, unsigned mask) {
  std::vector<Clock>& joined = scratch_;  // kept: lenient racecheck syncs a warp at every collective op
  joined.assign(width_, 0);
  for (unsigned lanes = mask; lanes; lanes &= lanes - 1) {
    const unsigned t = warp * 32 + static_cast<unsigned>(__builtin_ctz(lanes));
    if (t < threads_) join_into(joined, row(t));
  }
  for (unsigned lanes = mask; lanes; lanes &= lanes - 1) {
    const unsigned t = warp * 32 + static_cast<unsigned>(__builtin_ctz(lanes));
    if (t >= threads_) continue;
    join_row(t, joined);
    tick(t);
  }
}

HappensBefore::MbarrierClocks& HappensBefore::mbarrier(const void* bar) {
  return mbarriers_[reinterpret_cast<uintptr_t>(bar)];
}

void HappensBefore::mbarrier_release(const void* bar, unsigned t) {
  join_into(mbarrier(bar).current, row(t));
  tick(t);
}

void HappensBefore::mbarrier_phase_completed(const void* bar) {
  MbarrierClocks& m = mbarrier(bar);
  m.completed.swap(m.current);
  m.current.assign(width_, 0);
}

void HappensBefore::mbarrier_acquire(const void* bar, unsigned t) { join_row(t, mbarrier(bar).completed); }

void HappensBefore::named_release(unsigned id, unsigned t) {
  join_into(named_[id], row(t));
  tick(t);
}

void HappensBefore::named_completed(unsigned id, const unsigned* waiting, unsigned warps) {
  for (unsigned w = 0; w < warps; ++w) {
    for (unsigned lanes = waiting[w]; lanes; lanes &= lanes - 1) {
      const unsigned t = w * 32 + static_cast<unsigned>(__builtin_ctz(lanes));
      if (t < threads_) join_row(t, named_[id]);
    }
  }
  named_[id].assign(width_, 0);  // the barrier's next use starts empty
}

std::vector<Clock> HappensBefore::issue_async(unsigned t) {
  std::vector<Clock> issued(row(t), row(t) + width_);
  tick(t);  // what t does after the issue is not ordered before the copy's landing
  return issued;
}

unsigned HappensBefore::land_async(const void* bar, const std::vector<Clock>& issued, Clock& clock) {
  MbarrierClocks& m = mbarrier(bar);
  if (m.agent < 0) m.agent = static_cast<int>(agents_used_++ % kAsyncAgents);
  const unsigned agent = threads_ + static_cast<unsigned>(m.agent);
  clock = ++agent_clock_[m.agent];
  join_into(m.current, issued.data());
  m.current[agent] = std::max(m.current[agent], clock);
  return agent;
}

void HappensBefore::proxy_fence(unsigned t) {
  fences_[t].push_back(Fence{generation_, now(t)});
  tick(t);  // writes after the fence are not covered by it
}

bool HappensBefore::fenced_before(unsigned u, Clock clock, unsigned t) const {
  // The first fence after the write: a later one happens before t only if this one does.
  const std::vector<Fence>& fences = fences_[u];
  const auto first = std::lower_bound(fences.begin(), fences.end(), clock,
                                      [](const Fence& f, Clock c) { return f.clock < c; });
  return first != fences.end() && before(u, first->generation, first->clock, t);
}

}  // namespace fagen_emu
