// Racecheck's reports (race_report.cpp): what a hazard names — its kind, the byte,
// both threads (or the copy), both .cu lines, and why nothing orders the two.
#pragma once

#include "runtime_internal.h"

namespace fagen_emu {

struct RaceContext {
  const BlockRun* block;
  const unsigned char* dynamic_base;
  const unsigned char* static_base;
  unsigned threads;                   // components from here on are async agents
};

// The access that finds the hazard.
struct Access {
  const unsigned char* byte;
  unsigned thread;
  bool write;
  SiteCode site;
  bool async_read = false;  // a TMA store / bulk reduction's read of its source, at issue
};

// The earlier access it conflicts with: a thread's, or an async agent's (a TMA load's landing).
struct Prior {
  unsigned by;
  unsigned issuer;  // of the TMA load, when `by` is an agent
  bool wrote;
  SiteCode site;
};

[[noreturn]] void report_unordered(const RaceContext& context, const Access& now, const Prior& before);
[[noreturn]] void report_pending_copy(const RaceContext& context, const Access& now, unsigned owner, SiteCode site,
                                      bool tma_load);
[[noreturn]] void report_async_read_in_flight(const RaceContext& context, const Access& now, unsigned owner,
                                              SiteCode site);
[[noreturn]] void report_missing_proxy_fence(const RaceContext& context, const Access& now, unsigned writer,
                                             SiteCode site);
[[noreturn]] void report_global_write(const RaceContext& context, const ThreadRef& t, const TensorRange& range,
                                      uint64_t offset, SiteCode site, uint64_t seen, SiteCode seen_site);

}  // namespace fagen_emu
