// fagen_emulate/wgmma.h — the emulated twins of templates/include/fagen/{wgmma,smem_desc}.cuh:
// wgmma .m64nNk16 (f16, bf16) and .m64nNk32 (e4m3, e5m2), f32 accumulators.
// Kernels call the wrappers, never these directly.
//
// wgmma ops are warpgroup-collective: the 128 threads of warps 4i..4i+3 must all call the same
// op at the same call site, or the launch fails. Emulated semantics (src/wgmma.cpp):
// - issue: the accumulators of every thread are filled with NaN (C is kept aside, or chained
//   from an in-flight wgmma on the same accumulators), and so are A's registers (their values
//   kept aside, restored by the retiring wait, a fault there if a thread wrote them); the
//   operand tiles are read once to remember their bytes and bounds-checked;
// - wgmma_wait(N) retires all committed groups but the N most recent, in issue order: the
//   shared operands are read again, a fault if any byte changed since issue, and D is written;
// - a wgmma whose accumulator (or A registers) a thread wrote since the twin last wrote them,
//   with no wgmma_fence in between, is a fault (the ISA's missing wgmma.fence);
// - descriptors: swizzle on the absolute shared-window address; base offset must be 0.
#pragma once

#include <cstdint>

namespace fagen_emu {

// Shared-window address of dynamic shared memory byte 0 (sm_90 reserves the first 1 KiB).
constexpr uint32_t kDynamicSharedWindowBase = 0x400;

FAGEN_EMU_RUNTIME_API uint32_t shared_window_address(const void* p, Site site);

// Input types: 16-bit ones (K = 16, A and B of one type, either major-ness) and 8-bit ones
// (K = 32, any pair, K-major only).
enum class WgmmaInput : int { f16 = 0, bf16 = 1, e4m3 = 2, e5m2 = 3 };

FAGEN_EMU_RUNTIME_API void wgmma_ss(WgmmaInput a_type, WgmmaInput b_type, int n, float* d, uint64_t a_desc,
                                    uint64_t b_desc, int scale_d, int scale_a, int scale_b, int trans_a, int trans_b,
                                    Site site);
FAGEN_EMU_RUNTIME_API void wgmma_rs(WgmmaInput a_type, WgmmaInput b_type, int n, float* d, const uint32_t* a,
                                    uint64_t b_desc, int scale_d, int scale_a, int scale_b, int trans_b, Site site);
FAGEN_EMU_RUNTIME_API void wgmma_fence(Site site);
FAGEN_EMU_RUNTIME_API void wgmma_commit(Site site);
FAGEN_EMU_RUNTIME_API void wgmma_wait(int pending_groups, Site site);

}  // namespace fagen_emu
