// fagen_emulate/tensor_map.h — fagen's own encoding of a CUtensorMap, as the emulator's TMA
// twin reads it. On a GPU the driver encodes the 128 bytes (cuTensorMapEncodeTiled) and only the
// hardware reads them; in the emulator fagen.kernels.tensor_map.TensorMapSpec.emulated_bytes
// writes this struct instead. A test compiles this header and checks every offset against the
// Python layout (tests/kernels/test_tensor_map.py), so the two cannot drift apart.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fagen_emu {

constexpr uint32_t kTensorMapMagic = 0x4D544746u;  // "FGTM": not a driver-encoded map
constexpr uint32_t kTensorMapVersion = 1;
constexpr int kTensorMapMaxRank = 5;

// Dims innermost first, as the driver takes them; unused dims hold 1 (strides 0).
struct alignas(64) EmulatedTensorMap {
  uint32_t magic;
  uint32_t version;
  uint64_t global_address;
  uint64_t global_dims[kTensorMapMaxRank];
  uint64_t global_strides[kTensorMapMaxRank - 1];  // bytes, of dims 1.. (dim 0 is contiguous)
  uint16_t box_dims[kTensorMapMaxRank];            // <= 256 (the driver's bound)
  uint16_t element_strides[kTensorMapMaxRank];     // <= 8
  uint8_t rank;
  uint8_t dtype;          // CUtensorMapDataType
  uint8_t element_bytes;
  uint8_t interleave;     // CUtensorMapInterleave
  uint8_t swizzle;        // CUtensorMapSwizzle: 0 none, 1 32B, 2 64B, 3 128B
  uint8_t l2_promotion;   // CUtensorMapL2promotion (no effect in the emulator)
  uint8_t oob_fill;       // CUtensorMapFloatOOBfill: 0 zeros, 1 NaN
};
static_assert(sizeof(EmulatedTensorMap) == 128, "a CUtensorMap is 128 bytes");

}  // namespace fagen_emu
