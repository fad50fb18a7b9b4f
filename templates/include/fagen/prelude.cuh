// fagen/prelude.cuh — the first include of every generated kernel source.
//
// Under NVRTC it pulls in the CUDA half/bfloat16 types. Under FAGEN_EMULATE
// (the host C++ compiler, see fagen/emulate/) it pulls in the SIMT emulator's
// runtime instead, which provides the same names on the CPU.
//
// FAGEN_EXPORT(kernel) follows each kernel entry: on the GPU it is empty; in
// the emulator it defines the host launch shim for that kernel.
//
// FAGEN_CALL_SITE_PARAMS(_FIRST) / FAGEN_CALL_SITE: the PTX wrappers (mma.cuh,
// ldmatrix.cuh, cp_async.cuh) take the kernel's file and line as defaulted
// trailing parameters under the emulator, so its fault messages name the
// kernel's line rather than the wrapper's; on the GPU they are empty.
#pragma once

#ifdef FAGEN_EMULATE
#include <fagen_emulate/runtime.h>
#define FAGEN_CALL_SITE_PARAMS_FIRST const char *fagen_call_file = __builtin_FILE(), int fagen_call_line = __builtin_LINE()
#define FAGEN_CALL_SITE_PARAMS , FAGEN_CALL_SITE_PARAMS_FIRST
#define FAGEN_CALL_SITE (::fagen_emu::Site{fagen_call_file, fagen_call_line})
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define FAGEN_EXPORT(kernel)
#define FAGEN_CALL_SITE_PARAMS
#define FAGEN_CALL_SITE_PARAMS_FIRST
#endif

// Fixed-width integers: NVRTC ships no <cstdint>.
#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <cstdint>
#endif

#ifndef FAGEN_EMULATE
namespace fagen {
// A pointer into shared memory as the 32-bit shared-window address that PTX's .shared operands
// take (ldmatrix, stmatrix, cp.async, mbarrier, TMA). The emulator's wrappers pass pointers.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
}  // namespace fagen
#endif
