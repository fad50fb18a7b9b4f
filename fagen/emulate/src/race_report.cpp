// Racecheck's reports (race_report.h). Each names the hazard's kind, the byte, the
// block, both threads (or the copy and the thread that issued it) with their .cu
// lines, and why nothing orders the two accesses.
#include "race_report.h"

#include <algorithm>

namespace fagen_emu {
namespace {

std::string describe_offset(const RaceContext& context, const unsigned char* p) {
  if (p >= context.dynamic_base && p < context.dynamic_base + kMaxDynamicSharedBytes)
    return "dynamic shared memory byte " + std::to_string(p - context.dynamic_base);
  return "static __shared__ byte " + std::to_string(p - context.static_base);
}

std::string describe_thread(unsigned linear) {
  return "thread " + std::to_string(linear) + " (warp " + std::to_string(linear / 32) + ", lane " +
         std::to_string(linear % 32) + ")";
}

std::string site_of(const RaceContext& context, SiteCode site) {
  return context.block->launch->instrumentation->describe_site(site);
}

std::string describe_now(const RaceContext& context, const Access& now) {
  const char* verb = now.async_read ? " issues an async-proxy read of it (a TMA store, bulk reduction or wgmma operand) at "
                                    : now.write ? " writes it at " : " reads it at ";
  return describe_thread(now.thread) + verb + site_of(context, now.site);
}

[[noreturn]] void fail_with(const RaceContext& context, const std::string& kind, const Access& now,
                            const std::string& before, const std::string& why) {
  fail_race("racecheck: " + kind + " hazard on " + describe_offset(context, now.byte) + " in " +
            describe_block(*context.block) + ": " + describe_now(context, now) + ", " + before + "; " + why);
}

std::string kind_of(bool now_writes, bool before_wrote) {
  if (before_wrote) return now_writes ? "write-after-write" : "read-after-write";
  return "write-after-read";
}

}  // namespace

void report_unordered(const RaceContext& context, const Access& now, const Prior& before) {
  if (before.by >= context.threads) {
    fail_with(context, kind_of(now.write, true) + " (TMA load)", now,
              "the TMA load " + describe_thread(before.issuer) + " issued at " + site_of(context, before.site) +
                  " wrote it",
              "the load's bytes are ordered before a thread only by a wait on its mbarrier's phase");
  }
  const bool same_warp = before.by / 32 == now.thread / 32;
  fail_with(context, kind_of(now.write, before.wrote), now,
            describe_thread(before.by) + (before.wrote ? " wrote it at " : " read it at ") +
                site_of(context, before.site),
            same_warp ? "lanes of one warp, and no __syncwarp between them"
                      : "no __syncthreads between them, and no named barrier or mbarrier phase orders them");
}

void report_pending_copy(const RaceContext& context, const Access& now, unsigned owner, SiteCode site,
                         bool tma_load) {
  const std::string before = describe_thread(owner) + " wrote it at " + site_of(context, site);
  if (tma_load) {
    fail_with(context, kind_of(now.write, true) + " (TMA load in flight)", now, before,
              "the TMA load into this byte has not landed: no thread has waited on its mbarrier's phase");
  }
  if (owner == now.thread) {
    fail_with(context, now.write ? "write-before-landing" : "read-before-landing", now, before,
              "the cp.async into this byte has not landed: its thread's cp.async wait comes later");
  }
  fail_with(context, kind_of(now.write, true) + " (cp.async in flight)", now, before,
            "the cp.async into this byte has not landed (its thread has not waited for it), whatever barriers "
            "came between");
}

void report_async_read_in_flight(const RaceContext& context, const Access& now, unsigned owner, SiteCode site) {
  fail_with(context, "write-after-read (bulk store in flight)", now,
            describe_thread(owner) + " issued a TMA store or bulk reduction reading it at " + site_of(context, site),
            "the async proxy may read the source until the bulk wait_group that retires the operation");
}

void report_missing_proxy_fence(const RaceContext& context, const Access& now, unsigned writer, SiteCode site) {
  fail_with(context, "missing fence.proxy.async", now,
            describe_thread(writer) + " wrote it at " + site_of(context, site),
            "no fence.proxy.async after the write, in its thread, happens before the issue: the async proxy may "
            "not see the generic proxy's write");
}

void report_global_write(const RaceContext& context, const ThreadRef& t, const TensorRange& range, uint64_t offset,
                         SiteCode site, uint64_t seen, SiteCode seen_site) {
  const BlockRun& block = *context.block;
  const LaunchConfig& config = block.launch->config;
  const auto coords = [&](uint64_t linear) {
    const uint64_t x = config.grid[0], y = config.grid[1];
    return "(" + std::to_string(linear % x) + "," + std::to_string(linear / x % y) + "," +
           std::to_string(linear / x / y) + ")";
  };
  fail_race("racecheck: write-after-write hazard in global memory: tensor argument " +
            std::to_string(range.argument) +
            " element " + std::to_string(offset / static_cast<uint64_t>(std::max(1, range.element_bytes))) +
            " (byte " + std::to_string(offset) + ") is written by " + describe_thread(t.linear) + " of block " +
            coords(block.linear_block) + " at " + site_of(context, site) + " and by " +
            describe_thread(static_cast<unsigned>(seen & 1023u)) + " of block " + coords((seen >> 10) - 1) + " at " +
            site_of(context, seen_site) +
            "; blocks run in no defined order: use an atomic, give each element one block, or order the blocks "
            "with a semaphore (fagen/semaphore.cuh)");
}

}  // namespace fagen_emu
