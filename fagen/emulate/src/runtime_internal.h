// Internal interfaces of the SIMT emulator runtime (not seen by kernels).
//
// Pieces:
//   fiber_context.cpp    switching between a block's fibers and its scheduler
//   block_scheduler.cpp  running one block: fibers, barrier, warp rendezvous,
//                        fault messages
//   warp_ops.cpp         shuffles, ballot, __syncwarp on top of the rendezvous
//   tensor_core.cpp      mma.sync and ldmatrix twins
//   cp_async.cpp         cp.async twins
//   mbarrier.cpp         mbarrier twins (phases, arrivals, tx-count)
//   named_barrier.cpp    bar.sync / bar.arrive with an id and a thread count
//   warp_specialize.cpp  elect.sync, setmaxnreg, fence.proxy.async
//   schedule_orders.cpp  the producer-first, consumer-first and random schedules
//   warpgroup.cpp        the warpgroup rendezvous (4 warps, 128 threads)
//   wgmma.cpp            wgmma twins and their shared-memory descriptors
//   launch.cpp           grid launch on a pool of OS threads, per-block shared memory
//   block_residency.cpp  resident blocks: parking on semaphores, the serial interleave,
//                        deadlock between blocks
//   semaphore.cpp        the global semaphore twins (wait until *sem == value, arrive)
//   instrument.cpp       the hooks an instrumented kernel module calls on every
//                        load and store (ThreadSanitizer's ABI, no libtsan)
//   racecheck.cpp        shadow state of shared memory: hazards between threads
//   happens_before.cpp   racecheck's vector clocks and the sync objects' clocks
//   race_report.cpp      racecheck's messages
//   counters.cpp         memory traffic, bank conflicts and op counts
//
// They are built into one shared library (compiled with
// -DFAGEN_EMU_BUILDING_RUNTIME) that every kernel module links against.
#pragma once

#include <fagen_emulate/runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
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
  uint32_t site;  // a SiteCode, when instrumenting
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
  const int* semaphore = nullptr;    // while blocked in a semaphore wait: the counter and its awaited value
  int semaphore_value = 0;
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

// -- instrumentation (racecheck.cpp, counters.cpp) ----------------------------------

// A thread as instrumentation names it.
struct ThreadRef {
  uint16_t linear;
  uint8_t warp;
  uint8_t lane;
};

// Where an access happened, in 32 bits: an offset into the kernel module (a
// return address of an instrumented access; Python turns it into a .cu line
// with addr2line), or, with the top bit set, an index into the launch's
// table of runtime sites (ldmatrix and cp.async name their kernel line).
using SiteCode = uint32_t;
constexpr SiteCode kRuntimeSiteBit = 0x80000000u;

// Racecheck: which block (and thread) stored each byte of a tensor.
struct GlobalShadow {
  explicit GlobalShadow(std::size_t bytes)
      : owner(new std::atomic<uint64_t>[bytes]()), site(new std::atomic<uint32_t>[bytes]()),
        epoch(new std::atomic<uint32_t>[bytes]()) {}
  std::unique_ptr<std::atomic<uint64_t>[]> owner;  // (block + 1) << 10 | thread; 0: not written
  std::unique_ptr<std::atomic<uint32_t>[]> site;
  std::unique_ptr<std::atomic<uint32_t>[]> epoch;  // the writer block's semaphore arrives before the write
};

// Racecheck across blocks: per block, the latest epoch (its semaphore arrives) of each other block
// whose global writes happen before (semaphore release -> acquire, transitively).
using BlockClock = std::unordered_map<uint64_t, uint32_t>;

// Counters: which bytes of a tensor were touched, one bit each.
struct UniqueBytes {
  explicit UniqueBytes(std::size_t bytes) : words((bytes + 63) / 64), bits(new std::atomic<uint64_t>[words]()) {}
  void mark(uint64_t offset, std::size_t count);
  uint64_t count() const;
  std::size_t words;
  std::unique_ptr<std::atomic<uint64_t>[]> bits;
};

struct Instrumentation {
  int32_t flags = 0;
  uintptr_t module_base = 0;  // the kernel module's load address
  uintptr_t module_end = 0;
  std::vector<TensorRange*> tensors;  // sorted by begin
  uintptr_t tensors_begin = 0, tensors_end = 0;  // the span they cover
  std::vector<std::unique_ptr<GlobalShadow>> written_by;    // parallel to tensors (racecheck)
  std::vector<std::unique_ptr<UniqueBytes>> read_bytes;     // parallel to tensors (counters)
  std::vector<std::unique_ptr<UniqueBytes>> written_bytes;
  std::mutex mutex;  // the site table and the launch totals
  std::vector<Site> sites;
  LaunchCounters totals{};
  std::mutex semaphore_mutex;  // racecheck: the clocks released into each semaphore, with its increments
  std::unordered_map<uintptr_t, BlockClock> semaphore_clocks;

  Instrumentation();
  ~Instrumentation();
  bool racecheck() const { return flags & kInstrumentRacecheck; }
  bool counting() const { return flags & kInstrumentCounters; }
  bool lenient() const { return flags & kInstrumentLenientWarp; }
  SiteCode runtime_site(Site site);
  std::string describe_site(SiteCode code);
  // The tensor holding [address, address + bytes), or -1.
  int tensor_of(uintptr_t address) const;
};

// The launch's resident blocks (block_residency.cpp): one per worker (OS thread). A block none of
// whose threads can run while some wait on semaphores is parked: it keeps its worker (resident, as a
// block keeps its SM) until some block arrives on a semaphore. All resident blocks parked with no
// arrive since they last checked: a deadlock. The serial interleave passes one token between them.
struct ParkedBlock {
  BlockRun* block;
  std::string waits;  // its other blocked threads, described on its own OS thread when it parked
};

struct Residency {
  std::mutex mutex;
  std::condition_variable changed;
  std::atomic<uint64_t> arrivals{0};  // semaphore arrives so far (the epoch parked blocks wait past)
  int workers = 0;
  int resident = 0;          // parallel: workers not yet out of blocks; serial: workers holding a block
  int parked_unchanged = 0;  // parked blocks that checked their waits after the latest arrive
  std::vector<ParkedBlock> parked;  // in dispatch order
  bool ended = false;        // failed (a fault, a deadlock): parked blocks are abandoned
  // serial interleave
  int token = 0;             // the worker that may run
  bool finished = false;     // every block has run
  std::vector<uint8_t> busy; // per worker: holds a block
  uint64_t next_block = 0;
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
  std::unique_ptr<Instrumentation> instrumentation;  // null unless config.instrument != 0
  Residency residency;

  void record_error(const std::string& message);
};

// -- warpgroup.cpp ---------------------------------------------------------------------
// A warpgroup-collective op (wgmma and its fence / commit / wait) as its compute function sees
// it: the operands of the 128 threads of warpgroup `group`, thread t = linear id - 128 * group.
struct WarpgroupRendezvous {
  const char* op = nullptr;
  Site site{};
  unsigned group = 0;
  const void* in[128] = {};
  void* out[128] = {};
};
using WarpgroupCompute = void (*)(WarpgroupRendezvous& rendezvous);
struct WgmmaState;  // wgmma.cpp: the warpgroup's wgmmas in flight and its fence bookkeeping

struct WarpgroupState {
  const char* op = nullptr;  // the op some threads wait in, or null
  Site site{};
  unsigned arrived = 0;
  uint32_t arrived_lanes[4] = {};
  std::shared_ptr<WgmmaState> wgmma;  // made at the warpgroup's first wgmma op
  unsigned registers = 0;             // setmaxnreg's count once set (0: the launch's)
};
constexpr unsigned kMaxWarpgroups = kMaxThreadsPerBlock / 128;

// All 128 threads of the caller's warpgroup at one op and call site; the last to arrive runs
// `compute`. A thread of the warpgroup that exits, waits at a barrier or in another op is a fault.
void warpgroup_collective(const char* op, const void* in, void* out, WarpgroupCompute compute, Site site);
// Scheduler hooks: the running thread exits, or reaches __syncthreads at `site`.
void warpgroup_check_exit(Fiber& fiber);
void warpgroup_check_barrier(Site site);
// " Warpgroup i: threads ... wait in op at site." for each warpgroup op some threads wait in.
std::string describe_warpgroup_waits(const BlockRun& block);

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
  WarpgroupState warpgroups[kMaxWarpgroups];  // warpgroup.cpp
  unsigned barrier_arrived = 0;
  unsigned barrier_lanes[32] = {};   // per warp: lanes waiting at the barrier
  Site barrier_site{};
  int barrier_count = 0;
  int first_exited = -1;             // linear id of the first thread that exited
  uint64_t idle_yields = 0;          // __nanosleep yields since a rendezvous last completed
  uint64_t barriers_completed = 0;
  bool yielded = false;              // a thread yielded in __nanosleep (warp-serial moves on)
  Fiber* running = nullptr;          // the fiber the scheduler resumed last
  unsigned semaphore_waiters = 0;    // threads blocked in a semaphore wait
  uint64_t semaphore_epoch = 0;      // Residency::arrivals when their values were last read
  uint64_t dispatch = 0;             // the block's place in the order blocks were handed out
  uint64_t linear_block = 0;
  bool failed = false;
  std::string error;
};

// Per OS thread that runs blocks: the fibers and their stacks, reused.
struct Worker {
  int index = 0;  // in the launch's pool
  FiberContext scheduler_context;
  StackBounds scheduler_stack;
  std::vector<Fiber> fibers;
  char* stack_region = nullptr;
  std::size_t region_bytes = 0;
  std::size_t stack_size = 0;

  void ensure_fibers(unsigned count, std::size_t stack_size);
};

extern __thread Fiber* current_fiber;

// Runs one block to completion; false (with the launch error recorded) on a fault. `dispatch`:
// the block's place in the order blocks are handed out.
bool run_block(Worker& worker, LaunchState& launch, uint64_t linear_block, uint64_t dispatch);
// "block (x,y,z)", and what the block's blocked threads wait for (barriers, warp ops, mbarriers,
// named barriers, warpgroups; not semaphores), for deadlock messages. Call it on the block's OS thread.
std::string describe_block(const BlockRun& block);
std::string describe_blocked_threads(const BlockRun& block);
// "thread 3 (threadIdx (3,0,0), warp 0, lane 3): " for fault messages.
std::string describe_thread(const Fiber& fiber);

// Fault in the running fiber: abandons the block. Never returns.
[[noreturn]] void fail_current(const std::string& message);
// A hazard racecheck found: `message` names both threads. Never returns.
[[noreturn]] void fail_race(const std::string& message);
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

// Instrumentation of one block, called by the scheduler (no-ops when the
// launch has none): a block starts or ends, a barrier completes, and the lanes
// `mask` of a warp synchronise (__syncwarp, or under the lenient switch any
// warp-collective op).
void instrument_block_start(BlockRun& block);
void instrument_block_end(BlockRun& block);
void instrument_barrier(BlockRun& block);
void instrument_warp_sync(BlockRun& block, unsigned warp, unsigned mask, bool collective);

// Shared-memory accesses the runtime makes on a thread's behalf (ldmatrix
// rows, cp.async destinations) and global reads (cp.async sources).
bool instrumenting();
ThreadRef thread_ref(const Fiber& fiber);
void shared_access(const ThreadRef& thread, const void* address, std::size_t bytes, bool write, SiteCode site);
void cp_async_issued(const ThreadRef& thread, const void* destination, SiteCode site);
void cp_async_landed(const ThreadRef& thread, const void* destination, SiteCode site);
void global_access(const ThreadRef& thread, const void* address, std::size_t bytes, bool write, bool atomic,
                   SiteCode site);
SiteCode runtime_site(Site site);
// Racecheck's happens-before edges from the sync twins and the asynchronous copies
// (no-ops unless race-checking): the running thread releases into an mbarrier's
// current phase (arrive, complete_tx); a phase completes; a thread acquires the last
// completed phase (a wait that saw it complete); a named barrier's arrival and
// completion (the threads of `waiting`, per warp, were in bar.sync); fence.proxy.async.
void mbarrier_released(const void* bar);
void mbarrier_phase_completed(const void* bar);
void mbarrier_acquired(const void* bar, unsigned thread);
void named_barrier_arrived(unsigned id);
void named_barrier_completed(unsigned id, const unsigned* waiting);
void proxy_fence_ran();
// A TMA load's issue (its destination is pending) and its landing (just before its
// complete_tx); a TMA store's or bulk reduction's read of its shared source, at issue
// and at the bulk wait that retires it.
void tma_load_issued(void* destination, std::size_t bytes, const void* bar, Site site);
void tma_load_landed(const void* destination, const void* bar);
void async_read_issued(const void* source, std::size_t bytes, Site site);
void async_read_retired(const void* source, std::size_t bytes, Site site);
// The same for an operand the async proxy reads on a thread's behalf (wgmma: the warpgroup's
// thread 0), at issue or, `retired`, at the wait that retires it.
void async_operand_read(const ThreadRef& thread, const void* source, std::size_t bytes, bool retired, SiteCode site);
// The site of a runtime op called from the kernel module at return address `pc` (so a
// report can name the .cu line through the inlined wrappers), else `fallback`.
SiteCode call_site(const void* pc, Site fallback);
// Counters of warp-collective ops: an mma, an ldmatrix's rows (for bank conflicts).
void count_mma();
void count_ldmatrix(const void* const* row_addresses, int matrices);
void count_cp_async(int src_bytes);
void count_proxy_fence();
// The name __syncwarp's rendezvous has (warp_ops.cpp): it orders lanes even when strict.
extern const char kSyncWarpOp[];

// racecheck.cpp (called by instrument.cpp)
void race_block_start(BlockRun& block);
void race_barrier();
void race_warp_sync(unsigned warp, unsigned mask);
bool race_shared_access(const ThreadRef& thread, const void* address, std::size_t bytes, bool write, SiteCode site);
void race_cp_async_issued(const ThreadRef& thread, const void* destination, SiteCode site);
void race_cp_async_landed(const ThreadRef& thread, const void* destination, SiteCode site);
void race_global_write(const ThreadRef& thread, int tensor, uintptr_t address, std::size_t bytes, SiteCode site);
void race_semaphore_release(int* sem);
void race_semaphore_acquire(const int* sem);
void race_mbarrier_release(const void* bar, unsigned thread);
void race_mbarrier_phase_completed(const void* bar);
void race_mbarrier_acquire(const void* bar, unsigned thread);
void race_named_release(unsigned id, unsigned thread);
void race_named_completed(unsigned id, const unsigned* waiting);
void race_proxy_fence(unsigned thread);
void race_tma_load_issued(const ThreadRef& thread, void* destination, std::size_t bytes, const void* bar,
                          SiteCode site);
void race_tma_load_landed(const void* destination, const void* bar);
void race_async_read_issued(const ThreadRef& thread, const void* source, std::size_t bytes, SiteCode site);
void race_async_read_retired(const ThreadRef& thread, const void* source, std::size_t bytes, SiteCode site);
// counters.cpp (called by instrument.cpp)
void counters_block_start(BlockRun& block);
void counters_flush(BlockRun& block);      // at barriers and at the block's end
void counters_block_end(BlockRun& block);  // adds the block's counts to the launch's
void counters_access(const ThreadRef& thread, uintptr_t address, std::size_t bytes, bool write, bool shared,
                     SiteCode site);
void counters_tensor_bytes(int tensor, uint64_t offset, std::size_t bytes, bool write, bool atomic);
void count_barrier();
void count_mma_op();
void count_philox();
void count_cp_async_copy(int src_bytes);
void count_proxy_fence_op();
void count_ldmatrix_rows(const void* const* rows, int matrices);
// Whether an address is the running block's shared memory (dynamic or static).
bool is_shared_address(const void* address);

// -- shared memory (launch.cpp) -------------------------------------------------
unsigned char* dynamic_shared_base();
// Fills this OS thread's shared memory with garbage bytes before a block of
// `kernel` runs: the dynamic buffer, and the kernel module's static
// __shared__ arrays (its thread_local storage).
void poison_block_shared_memory(void (*kernel)(), std::size_t dynamic_bytes);
// This OS thread's copy of the kernel module's static __shared__ arrays.
struct StaticShared {
  unsigned char* data = nullptr;
  std::size_t size = 0;
};
StaticShared static_shared_of(void (*kernel)());

// -- swizzles (tma_box.cpp, wgmma.cpp) ---------------------------------------------------
// TMA and wgmma permute 16-byte chunks by the absolute shared address: bits [4, 4+bits) ^= bits
// [7, 7+bits), with bits = 1, 2, 3 for the 32B, 64B, 128B swizzles (each names them by its own
// numbers: CUtensorMapSwizzle 1, 2, 3; a wgmma descriptor 3, 2, 1).
inline uintptr_t swizzled_shared_address(uintptr_t address, unsigned bits) {
  return address ^ (((address >> 7) & ((uintptr_t{1} << bits) - 1)) << 4);
}

// -- cp_async.cpp -------------------------------------------------------------------
void land_all_copies(Fiber& fiber);

// -- warp specialisation: mbarrier.cpp, named_barrier.cpp, warp_specialize.cpp -------
// Their per-block state is thread_local (one block per OS thread at a time; a block parked on a
// semaphore keeps its OS thread, block_residency.cpp), cleared
// when a block starts (the *_block_start calls); the describe_* name what blocked
// threads wait for, for the deadlock message.
void mbarrier_block_start();
void named_barrier_block_start();
std::string describe_mbarrier_waits(const BlockRun& block);
std::string describe_named_barrier_waits(const BlockRun& block);
// __syncthreads is barrier 0: it must not meet a named use of barrier 0 in progress.
void check_named_barrier_zero_idle(Site site);
// TMA (tma.cpp): a load in flight lands when its barrier's phase waits for transaction bytes
// alone and a thread waits on it; mbarrier.cpp calls tma_land_loads then.
void tma_land_loads(void* bar);
bool mbarrier_waits_for_tx_only(void* bar);  // mbarrier.cpp: no arrival pending, tx bytes, a waiter
void tma_block_start();
std::string tma_block_end();  // "" or why the block may not end so (a bulk operation still reading)
// "" or the calling thread's first bulk operation whose writes no wait_group has seen done.
std::string bulk_writes_in_flight();

// -- blocks that wait on each other: block_residency.cpp, semaphore.cpp -------------------
// Before the workers start: `workers` OS threads will run the grid.
void start_residency(LaunchState& launch, int workers);
// The worker loop: takes blocks (parallel: as fast as it can; serial: when handed the token) until
// the grid is done or the launch fails.
void run_blocks(Worker& worker, LaunchState& launch);
// The scheduler found no runnable thread while some wait on semaphores: the block waits (keeping
// its OS thread) until an arrive may have released one (true), or the launch ended (false).
bool park_block(BlockRun& block);
// Every semaphore arrive: parked blocks re-check their waits.
void semaphore_arrived(LaunchState& launch);
// semaphore.cpp: re-reads the waits of a block's blocked threads if some arrive came since they
// were last read; true if one became runnable or one is past its value (the block has failed).
bool recheck_semaphore_waits(BlockRun& block);
// A waiting thread's value is there (or past it): the parked block can go on. Called under the
// residency lock, on any OS thread, while `block` is parked.
bool semaphore_waits_ready(const BlockRun& block);
// " Thread t waits in semaphore wait at SITE for the semaphore at ARG + OFFSET to equal M (it is N)."
std::string describe_semaphore_waits(const BlockRun& block);
// The arrive's increment (instrument.cpp); under racecheck the running block's global writes so far
// happen before those of a block that acquires the semaphore after it (the clock is released into
// the semaphore together with the increment).
void semaphore_release(int* sem);
void semaphore_acquired(BlockRun& block, const int* sem);

// -- the reordering schedules (schedule_orders.cpp) ----------------------------------
bool schedule_reorders(int32_t schedule);  // producer-first, consumer-first, random
void run_reordering_schedule(Worker& worker, BlockRun& block);
// After an op released waiting threads: under a reordering schedule the running
// thread (still runnable) hands the choice of who runs next to the scheduler.
void reschedule_after_release();
// block_scheduler.cpp, for the schedules
void resume_fiber(Worker& worker, Fiber& fiber);
void fail_deadlock_unless(bool ran, BlockRun& block);

}  // namespace fagen_emu
