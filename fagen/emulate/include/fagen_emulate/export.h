// fagen_emulate/export.h — FAGEN_EXPORT(kernel): the C entry points the Python
// launcher (fagen/emulate/module.py) calls through ctypes.
//
// For `extern "C" __global__ void k(P0, P1, ...)` followed by FAGEN_EXPORT(k)
// the shared library exports:
//   int fagen_launch_k(const fagen_emu::LaunchConfig*, void** args,
//                      char* error, unsigned long error_size);
//     Runs the grid. args[i] points at the value of parameter i (as with
//     cudaLaunchKernel). Returns 0, or nonzero with a message in `error`.
//   const char* fagen_signature_k();
//     The parameter types, comma-separated: "i32", "u32", "i64", "u64",
//     "f32", "f64", ..., and pointers as "p:<pointee>" or "pc:<pointee>"
//     (pointer to const), e.g. "pc:f16,p:f32,i32,i64".
// and registers k so that fagen_emulate_kernels() lists it. Every module also
// exports fagen_emulate_kernels() ("k1,k2") and fagen_emulate_abi_version() (5).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>

namespace fagen_emu {

// The order in which a block's threads take turns (fagen/emulate/README.md).
enum Schedule : int32_t {
  kScheduleForward = 0,           // thread by thread, increasing; warps advance in lockstep
  kScheduleReverse = 1,           // the same, decreasing
  kScheduleWarpSerial = 2,        // one warp runs until it waits at a block barrier, then the next
  kScheduleWarpSerialReverse = 3, // the same, from the last warp
  // The reordering schedules (src/schedule_orders.cpp): after every block, named or mbarrier
  // release the scheduler picks who runs next.
  kScheduleProducerFirst = 4,     // warpgroup 0 (the producer by convention) whenever it can run
  kScheduleConsumerFirst = 5,     // the other warpgroups whenever they can run
  kScheduleRandom = 6,            // a random warp runs its runnable lanes, from LaunchConfig::seed
};

// The order in which blocks are handed to the OS threads (with one OS thread, the
// order they run in): linear block index increasing, or decreasing. Reversal reorders
// whatever blocks race on (float atomics into one element, the last writer of a
// shared output), which is how a test shows that a non-deterministic variant's
// results can differ between runs.
enum BlockOrder : int32_t {
  kBlockOrderForward = 0,
  kBlockOrderReverse = 1,
};

// How blocks interleave (FAGEN_EMULATE_BLOCK_INTERLEAVE): in parallel on the OS threads, or one at a
// time, the running block going on until it exits or parks on a semaphore, then the first parked
// block (in dispatch order) whose awaited value is there, else the next block of the grid; serial
// makes the order of the blocks' global writes a function of the program alone.
enum BlockInterleave : int32_t {
  kBlockInterleaveParallel = 0,
  kBlockInterleaveSerial = 1,
};

// Instrumentation a launch asks for; it needs a module built with instrument=True
// (every plain load and store of the kernel reaches the runtime).
enum InstrumentFlags : int32_t {
  kInstrumentRacecheck = 1,   // shared-memory hazards and unsynchronised global writes
  kInstrumentCounters = 2,    // memory traffic, bank conflicts, mma, barriers, Philox
  kInstrumentLenientWarp = 4, // warp-collective ops order the lanes of a warp (pre-Volta view)
};

// One tensor argument, so that global accesses can be attributed to it. The
// runtime fills the counters when kInstrumentCounters is set.
enum TensorFlags : int32_t { kTensorWritable = 1 };  // a pointer to non-const

struct TensorRange {
  uint64_t begin;               // address of the first byte the kernel may touch
  uint64_t bytes;
  int32_t argument;             // its parameter index
  int32_t element_bytes;
  int32_t flags;                // TensorFlags
  int32_t reserved;
  uint64_t read_bytes;          // plain loads and cp.async sources
  uint64_t written_bytes;       // plain stores
  uint64_t atomic_bytes;        // atomic read-modify-writes
  uint64_t unique_read_bytes;   // distinct bytes read
  uint64_t unique_written_bytes;
};

// Per-launch counters (kInstrumentCounters). A warp-level access groups the
// lanes of one warp that execute the same load or store for the same time.
struct LaunchCounters {
  uint64_t blocks;
  uint64_t global_load_requests, global_load_sectors;    // 32-byte sectors per warp-level load
  uint64_t global_store_requests, global_store_sectors;
  uint64_t shared_load_requests, shared_load_wavefronts, shared_load_conflicts;
  uint64_t shared_store_requests, shared_store_wavefronts, shared_store_conflicts;
  uint64_t ldmatrix_requests, ldmatrix_wavefronts, ldmatrix_conflicts;  // conflicts: wavefronts past the minimum
  uint64_t mma;              // warp-level mma.sync m16n8k16
  uint64_t barriers;         // completed __syncthreads, summed over blocks
  uint64_t philox_calls;     // per thread
  uint64_t cp_async_copies;  // 16-byte cp.async issued
  uint64_t cp_async_bytes;   // bytes they read from global memory (src-size)
  uint64_t proxy_fences;     // fence.proxy.async, per thread
};

// Mirrored by ctypes in fagen/emulate/abi.py.
struct LaunchConfig {
  uint32_t grid[3];
  uint32_t block[3];
  uint64_t shared_mem_bytes;
  int32_t os_threads;  // blocks run in parallel on up to this many OS threads
  int32_t schedule;    // a Schedule
  int32_t instrument;  // InstrumentFlags
  int32_t block_order; // a BlockOrder
  uint32_t tensor_count;
  TensorRange* tensors;
  LaunchCounters* counters;
  uint64_t seed;       // the random schedule's (FAGEN_EMULATE_SEED)
  int32_t block_interleave;  // a BlockInterleave
  int32_t reserved;
};

using KernelThunk = void (*)(void (*kernel)(), void** args);

struct KernelEntry {
  const char* name;
  void (*kernel)();
  KernelThunk thunk;
};

FAGEN_EMU_RUNTIME_API int launch(const KernelEntry& entry, const LaunchConfig* config, void** args,
                                 char* error, unsigned long error_size) noexcept;

template <class... P, std::size_t... I>
inline void call_with_args(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<P>*>(args[I])...);
}

template <class... P>
inline void kernel_thunk(void (*kernel)(), void** args) {
  call_with_args(reinterpret_cast<void (*)(P...)>(kernel), args, std::index_sequence_for<P...>{});
}

template <class T> struct ScalarCode { static constexpr const char* value = nullptr; };
#define FAGEN_EMU_SCALAR_CODE(type, code) \
  template <> struct ScalarCode<type> { static constexpr const char* value = code; };
FAGEN_EMU_SCALAR_CODE(bool, "b8")
FAGEN_EMU_SCALAR_CODE(char, "i8")
FAGEN_EMU_SCALAR_CODE(signed char, "i8")
FAGEN_EMU_SCALAR_CODE(unsigned char, "u8")
FAGEN_EMU_SCALAR_CODE(short, "i16")
FAGEN_EMU_SCALAR_CODE(unsigned short, "u16")
FAGEN_EMU_SCALAR_CODE(int, "i32")
FAGEN_EMU_SCALAR_CODE(unsigned int, "u32")
FAGEN_EMU_SCALAR_CODE(long, "i64")
FAGEN_EMU_SCALAR_CODE(unsigned long, "u64")
FAGEN_EMU_SCALAR_CODE(long long, "i64")
FAGEN_EMU_SCALAR_CODE(unsigned long long, "u64")
FAGEN_EMU_SCALAR_CODE(float, "f32")
FAGEN_EMU_SCALAR_CODE(double, "f64")
FAGEN_EMU_SCALAR_CODE(__half, "f16")
FAGEN_EMU_SCALAR_CODE(__nv_bfloat16, "bf16")
FAGEN_EMU_SCALAR_CODE(void, "void")
#undef FAGEN_EMU_SCALAR_CODE

// Appends one parameter's code ("?<bytes>" for a type the launcher cannot pass).
// Plain char buffers, not std::string: <string> would add to every kernel build.
template <class T>
inline void append_parameter_code(char* out, std::size_t size) {
  const char* kind = "";
  const char* code = nullptr;
  if constexpr (std::is_pointer<T>::value) {
    using Pointee = std::remove_cv_t<std::remove_pointer_t<T>>;
    kind = std::is_const<std::remove_pointer_t<T>>::value ? "pc:" : "p:";
    code = ScalarCode<Pointee>::value ? ScalarCode<Pointee>::value : "any";  // struct/vector: any dtype
  } else {
    code = ScalarCode<std::remove_cv_t<T>>::value;
  }
  const std::size_t used = std::strlen(out);
  if (code) {
    std::snprintf(out + used, size - used, "%s%s%s", used ? "," : "", kind, code);
  } else {
    std::snprintf(out + used, size - used, "%s?%zu", used ? "," : "", sizeof(T));
  }
}

template <class... P>
inline const char* kernel_signature(void (*)(P...)) {
  static char signature[1024] = "";
  if (signature[0] == '\0') (append_parameter_code<P>(signature, sizeof signature), ...);
  return signature;
}

template <class... P>
inline KernelEntry kernel_entry(const char* name, void (*kernel)(P...)) {
  return KernelEntry{name, reinterpret_cast<void (*)()>(kernel), &kernel_thunk<P...>};
}

// This module's kernels, comma-separated (this inline function and its
// static are hidden, so each kernel module has its own list).
inline char* module_kernel_list() {
  static char list[8192] = "";
  return list;
}

struct KernelRegistration {
  explicit KernelRegistration(const char* name) {
    char* list = module_kernel_list();
    const std::size_t used = std::strlen(list);
    std::snprintf(list + used, 8192 - used, "%s%s", used ? "," : "", name);
  }
};

}  // namespace fagen_emu

#define FAGEN_EMU_API extern "C" __attribute__((visibility("default")))

#ifndef FAGEN_EMU_BUILDING_RUNTIME
// Defined once per kernel module: a generated source includes the prelude,
// hence this header, exactly once.
FAGEN_EMU_API const char* fagen_emulate_kernels() { return ::fagen_emu::module_kernel_list(); }
FAGEN_EMU_API int fagen_emulate_abi_version() { return 5; }
#endif

#define FAGEN_EXPORT(kernel)                                                                            \
  FAGEN_EMU_API int fagen_launch_##kernel(const ::fagen_emu::LaunchConfig* config, void** args,         \
                                          char* error, unsigned long error_size) {                      \
    return ::fagen_emu::launch(::fagen_emu::kernel_entry(#kernel, &kernel), config, args, error,        \
                               error_size);                                                             \
  }                                                                                                     \
  FAGEN_EMU_API const char* fagen_signature_##kernel() { return ::fagen_emu::kernel_signature(&kernel); } \
  static const ::fagen_emu::KernelRegistration fagen_registration_##kernel{#kernel};
