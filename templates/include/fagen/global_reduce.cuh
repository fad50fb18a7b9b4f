// fagen/global_reduce.cuh — fp32 additions into global memory from many thread blocks
// (the backward's dQ accumulator).
//
// atomic_add_pair adds two adjacent floats (8-byte aligned): on sm_90 and later one
// vector reduction, red.global.add.v2.f32 (PTX ISA 8.1+, one REDG.F32x2), elsewhere two
// scalar atomicAdds. The sum's order across blocks is the hardware's: results are not
// bit-reproducible, which is why deterministic variants never call it.
//
// Emulated twin: two atomicAdds (fagen_emulate/intrinsics.h), real atomics on the host.
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

__device__ __forceinline__ void atomic_add_pair(float* address, float first, float second) {
#if !defined(FAGEN_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(first), "f"(second) : "memory");
#else
  atomicAdd(address, first);
  atomicAdd(address + 1, second);
#endif
}

}  // namespace fagen
