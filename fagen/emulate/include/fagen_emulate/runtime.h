// fagen_emulate/runtime.h — the CUDA names a generated kernel uses, for the
// host C++ compiler. Included by <fagen/prelude.cuh> under -DFAGEN_EMULATE.
//
// The model (fagen/emulate/README.md has the whole contract):
// - each CUDA thread is a fiber; all threads of a block run cooperatively on
//   one OS thread, switching only at barriers and warp-collective operations;
//   blocks run in parallel on several OS threads, one block per OS thread at
//   a time;
// - `__shared__` is `thread_local`: static shared arrays and the dynamic
//   `extern __shared__ unsigned char smem[]` (defined by the runtime library)
//   are per OS thread, hence per block. The runtime fills them with 0xFF
//   bytes (NaN for float/half/bf16) before each block, as uninitialised
//   shared memory is on the GPU;
// - a fault (a barrier some live threads never reach, a warp-collective op
//   called by part of a warp, an assert, ...) ends the launch with an error
//   message for the Python side; it never aborts the process or hangs.
#pragma once

#ifndef FAGEN_EMULATE
#error "fagen_emulate/runtime.h is the host emulator's runtime: compile with -DFAGEN_EMULATE"
#endif

#include <math.h>  // exp2f, fmaxf, ... in the global namespace, as CUDA has them

#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// -- CUDA qualifiers ---------------------------------------------------------
// cuda_fp16.h pulls in CUDA's host_defines.h, which defines these to
// annotations; redefine them for plain host code.
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __managed__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
// Plain `inline`: always_inline on every helper only slows the host build. The
// instrumented build inlines them all, so that a report's inline chain reaches
// the kernel's own .cu line.
#ifdef FAGEN_EMU_ALWAYS_INLINE
#define __forceinline__ inline __attribute__((always_inline))
#else
#define __forceinline__ inline
#endif
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// thread_local at block scope implies static, so both `__shared__ float x[8];`
// and `extern __shared__ unsigned char smem[];` keep their CUDA meaning, with
// one instance per OS thread, i.e. per running block. `__restrict__` is a GNU
// keyword already.
#define __shared__ thread_local

// The runtime is one shared library that every kernel module links against
// (one thread pool, one set of fiber stacks, one dynamic shared memory buffer
// per OS thread for all modules); these are its exported entry points.
#define FAGEN_EMU_RUNTIME_API __attribute__((visibility("default")))

namespace fagen_emu {

// Where a kernel called a barrier or warp-collective op: the fault messages
// name it. Filled by __builtin_FILE()/__builtin_LINE() default arguments.
struct Site {
  const char* file;
  int line;
};

struct ThreadCoords {
  uint3 thread_idx;
  unsigned linear;  // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
  unsigned warp;    // linear / 32
  unsigned lane;    // linear % 32
};

// blockDim and gridDim are uint3 (CUDA's are dim3, which converts from uint3):
// a __thread variable needs a type without a constructor.
struct BlockCoords {
  uint3 block_idx;
  uint3 block_dim;
  uint3 grid_dim;
};

// Set by the scheduler before it resumes a fiber. `__thread` (not
// thread_local): no TLS wrapper call on each access.
extern __thread const ThreadCoords* current_thread FAGEN_EMU_RUNTIME_API;
extern __thread BlockCoords current_block FAGEN_EMU_RUNTIME_API;

// Ends the launch with an error naming the block and thread. Never returns.
[[noreturn]] FAGEN_EMU_RUNTIME_API void fail(Site site, const char* format, ...)
    __attribute__((format(printf, 2, 3)));
[[noreturn]] FAGEN_EMU_RUNTIME_API void assert_failed(const char* expression, const char* file, int line);
// Lets the other threads of the block run (used by __nanosleep spin loops).
FAGEN_EMU_RUNTIME_API void yield_to_block();
// Counts one Philox4x32-10 call when the launch collects counters (fagen/philox.cuh).
FAGEN_EMU_RUNTIME_API void count_philox_call();

}  // namespace fagen_emu

#define threadIdx (::fagen_emu::current_thread->thread_idx)
#define blockIdx (::fagen_emu::current_block.block_idx)
#define blockDim (::fagen_emu::current_block.block_dim)
#define gridDim (::fagen_emu::current_block.grid_dim)
#define warpSize 32

// Device-side assert: a failed one ends the launch with an EmulationError.
#undef assert
#ifdef NDEBUG
#define assert(expression) ((void)0)
#else
#define assert(expression) \
  (static_cast<bool>(expression) ? (void)0 : ::fagen_emu::assert_failed(#expression, __FILE__, __LINE__))
#endif

#include <fagen_emulate/intrinsics.h>
#include <fagen_emulate/warp.h>
#include <fagen_emulate/tensor_core.h>
#include <fagen_emulate/mbarrier.h>
#include <fagen_emulate/warp_specialize.h>
#include <fagen_emulate/wgmma.h>
#include <fagen_emulate/semaphore.h>
#include <fagen_emulate/export.h>
