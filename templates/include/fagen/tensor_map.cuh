// fagen/tensor_map.cuh — the type of a TMA operand's tensor map as a kernel parameter:
//   extern "C" __global__ void k(const __grid_constant__ fagen::TensorMap q_map, ...)
//
// On a GPU it is the driver's opaque 128-byte CUtensorMap (cuTensorMapEncodeTiled writes it;
// fagen.kernels.tensor_map.TensorMapSpec.driver_bytes), declared here as 16 words because NVRTC
// kernels do not include cuda.h. `__grid_constant__` keeps the parameter in constant space, so
// its generic address (&q_map) is what cp.async.bulk.tensor takes.
//
// In the emulator it is fagen's own encoding of the same map (fagen_emulate/tensor_map.h,
// TensorMapSpec.emulated_bytes), which only the emulated TMA twin reads; the launcher passes its
// bytes by value, 64-byte aligned.
#pragma once

#include <fagen/prelude.cuh>

#ifdef FAGEN_EMULATE
#include <fagen_emulate/tensor_map.h>
#endif

namespace fagen {

#ifdef FAGEN_EMULATE
using TensorMap = ::fagen_emu::EmulatedTensorMap;
#else
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};
#endif
static_assert(sizeof(TensorMap) == 128, "a CUtensorMap is 128 bytes");

}  // namespace fagen
