// Internal interfaces of the SIMT emulator runtime (not seen by kernels).
//
// Pieces:
//   fiber_context.cpp    switching between a block's fibers and its scheduler
//   block_scheduler.cpp  running one block: fibers, barrier, warp rendezvous,
//                        fault messages
//   warp_ops.cpp         shuffles, ballot, __syncwarp on top of the rendezvous
//   tensor_core.cpp      mma.sync and ldmatrix twins
//   cp_async.cpp         cp.async twins
//   launch.cpp           grid launch on a pool of OS threads, per-block shared memory
//
// They are built into one shared library (compiled with
// -DFAGEN_EMU_BUILDING_RUNTIME) that every kernel module links against.
#pragma once

#include <fagen_emulate/runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define FAGEN_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FAGEN_EMU_ASAN 1
#endif
#endif

#if defined(__x86_64__) && !defined(FAGEN_EMU_FORCE_UCONTEXT)
#define FAGEN_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace fagen_emu {

// The largest dynamic shared memory one block may use: sm_90's 227 KiB.
constexpr std::size_t kMaxDynamicSharedBytes = 232448;
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned char kGarbageByte = 0xFF;  // NaN as fp32, fp16 and bf16

// -- fiber_context.cpp ------------------------------------------------------------

struct FiberContext {
#ifdef FAGEN_EMU_ASM_SWITCH
  void* stack_pointer = nullptr;
#else
  ucontext_t context;
#endif
};

struct StackBounds {
  const void* bottom = nullptr;
  std::size_t size = 0;
};

using FiberEntry = void (*)(void* argument);

// Makes `context` start `entry(argument)` on the given stack when first switched to.
void prepare_context(FiberContext& context, char* stack, std::size_t stack_size, FiberEntry entry,
                     void* argument);
// Saves the running context into `from` and resumes `to`. Under ASan the
// fiber-switch annotations are made here: `to_stack` bounds the target stack;
// `from_finished` says the current fiber will never be resumed.
void switch_context(FiberContext& from, FiberContext& to, const StackBounds& to_stack, bool from_finished);
// Called first thing on a new fiber: returns the stack we came from (ASan only).
StackBounds fiber_started();
// Under ASan, clears the shadow of a stack about to be reused; no-op otherwise.
void unpoison_stack(char* stack, std::size_t size);

// -- block_scheduler.cpp ------------------------------------------------------------

enum class FiberState : uint8_t { runnable, blocked, exited };

struct PendingCopy {
  unsigned char* destination;
  uint32_t group;
  unsigned char data[16];
};

struct BlockRun;
struct Worker;

struct Fiber {
  ThreadCoords coords{};
  FiberContext context;
  char* stack = nullptr;
  std::size_t stack_size = 0;
  FiberState state = FiberState::exited;
  const char* blocked_in = nullptr;  // the op this fiber waits in, for messages
  Site blocked_site{};
  int barrier_result = 0;
  const void* collective_in = nullptr;  // operands while waiting in a warp-collective op
  void* collective_out = nullptr;
  uint32_t committed_groups = 0;     // cp.async groups committed so far
  std::vector<PendingCopy> copies;   // cp.async copies not yet landed, in issue order
  BlockRun* block = nullptr;
};

// A completed warp-collective op as its compute function sees it: the
// operands of every lane in `mask` (in/out of other lanes are null).
struct WarpRendezvous {
  const char* op = nullptr;
  Site site{};
  unsigned mask = 0;
  const void* in[32] = {};
  void* out[32] = {};
};
using CollectiveCompute = void (*)(WarpRendezvous& rendezvous);

// A warp-collective op some lanes wait in. One warp may have several at once,
// with disjoint lanes (e.g. lanes 0-15 in a shuffle with mask 0xffff while
// lanes 16-31 already wait in a full-warp one further on).
struct PendingCollective {
  const char* op;
  Site site;
  unsigned mask;
  unsigned arrived;
  CollectiveCompute compute;
};

struct WarpState {
  PendingCollective pending[32];
  unsigned count = 0;

  // The pending op that expects `lane` and that it has not joined, if any.
  const PendingCollective* awaiting(unsigned lane) const {
    for (unsigned i = 0; i < count; ++i)
      if ((pending[i].mask >> lane & 1u) && !(pending[i].arrived >> lane & 1u)) return &pending[i];
    return nullptr;
  }
};

struct LaunchState {
  KernelEntry entry{};
  void** args = nullptr;
  LaunchConfig config{};
  uint64_t total_blocks = 0;
  std::size_t stack_size = 0;
  std::atomic<uint64_t> next_block{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string error;

  void record_error(const std::string& message);
};

struct BlockRun {
  LaunchState* launch = nullptr;
  Worker* worker = nullptr;
  uint3 block_idx{};
  unsigned thread_count = 0;
  unsigned warp_count = 0;
  Fiber* fibers = nullptr;
  unsigned live = 0;                 // threads not exited
  unsigned live_lanes[32] = {};      // per warp: lanes that exist and have not exited
  WarpState warps[32];
  unsigned barrier_arrived = 0;
  unsigned barrier_lanes[32] = {};   // per warp: lanes waiting at the barrier
  Site barrier_site{};
  int barrier_count = 0;
  int first_exited = -1;             // linear id of the first thread that exited
  uint64_t idle_yields = 0;          // __nanosleep yields since a rendezvous last completed
  bool failed = false;
  std::string error;
};

// Per OS thread that runs blocks: the fibers and their stacks, reused.
struct Worker {
  FiberContext scheduler_context;
  StackBounds scheduler_stack;
  std::vector<Fiber> fibers;
  char* stack_region = nullptr;
  std::size_t region_bytes = 0;
  std::size_t stack_size = 0;

  void ensure_fibers(unsigned count, std::size_t stack_size);
};

extern __thread Fiber* current_fiber;

// Runs one block to completion; false (with the launch error recorded) on a fault.
bool run_block(Worker& worker, LaunchState& launch, uint64_t linear_block);

// Fault in the running fiber: abandons the block. Never returns.
[[noreturn]] void fail_current(const std::string& message);
// Parks the running fiber in `op` until a rendezvous releases it.
void block_current(const char* op, Site site);
// A warp-collective op: see warp.h for the rules it enforces.
void warp_collective(const char* op, unsigned mask, const void* in, void* out, CollectiveCompute compute,
                     Site site);

std::string format_site(Site site);
std::string format_lanes(unsigned lanes);
std::string format_threads(const std::vector<unsigned>& linear_ids);
// Fails if [address, address + bytes) lies partly past the launch's dynamic
// shared memory (addresses outside the dynamic buffer are not checked).
void check_dynamic_shared_range(const void* address, std::size_t bytes, const char* what, Site site);

// -- shared memory (launch.cpp) -------------------------------------------------
unsigned char* dynamic_shared_base();
// Fills this OS thread's shared memory with garbage bytes before a block of
// `kernel` runs: the dynamic buffer, and the kernel module's static
// __shared__ arrays (its thread_local storage).
void poison_block_shared_memory(void (*kernel)(), std::size_t dynamic_bytes);

// -- cp_async.cpp -------------------------------------------------------------------
void land_all_copies(Fiber& fiber);

}  // namespace fagen_emu
