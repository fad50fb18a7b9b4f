// fagen/smem_desc.cuh — wgmma's shared-memory matrix descriptors and the swizzles they name
// (PTX ISA, "Matrix Descriptor Format" and "Shared Memory Matrix Layout" in the wgmma section).
//
// A descriptor is 64 bits:
//   bits 13-0   start address >> 4        (the operand's first byte, a shared-window address)
//   bits 29-16  leading-dimension byte offset >> 4 (LBO)
//   bits 45-32  stride-dimension byte offset >> 4  (SBO)
//   bits 51-49  base offset               (for start addresses off the swizzle pattern; 0 here)
//   bits 63-62  swizzle: 0 none (interleave), 1 128B, 2 64B, 3 32B
//
// Operands are tiles of "core matrices": 8 rows of 16 bytes. With T = 16 bytes / element size
// and W the swizzle width in bytes (16 for none, else 32, 64, 128), element (mn, k) of a
// K x MN operand sits at start + offset, then swizzled:
//   K-major,  none:     (mn % 8) * 16 + (mn / 8) * SBO + (k / T) * LBO + (k % T) * size
//   K-major,  swizzled: (mn % 8) * W  + (mn / 8) * SBO + k * size            (LBO unused)
//   MN-major, none:     (k % 8) * 16  + (k / 8) * LBO  + (mn / T) * SBO + (mn % T) * size
//   MN-major, swizzled: (k % 8) * W   + (k / 8) * SBO  + (mn / (W / size)) * LBO + (mn % (W / size)) * size
// So LBO steps along K and SBO along MN, except for swizzled MN-major tiles, where LBO steps
// from one W-byte-wide column of MN to the next and SBO from one group of 8 k to the next.
// The swizzle XORs bits of the ABSOLUTE shared address, not of an offset in the tile:
//   128B: bits 4-6 ^= bits 7-9;  64B: bits 4-5 ^= bits 7-8;  32B: bit 4 ^= bit 7
// so a tile written through swizzle_address() must sit where the wgmma reads it (e.g. 1024-byte
// aligned for 128B, as the descriptor's base offset is left 0).
//
// No PTX here except the shared-window address: builders are plain bit arithmetic, the same on
// the GPU and in the emulator, whose decoder (fagen/emulate/src/wgmma.cpp) is the twin's reading.
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

enum SmemSwizzle : uint32_t { kSwizzleNone = 0, kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };

// The shared-window address (what descriptors and swizzles see) of a pointer into shared memory.
// Emulated: dynamic shared memory only; its byte 0 sits at 0x400, past sm_90's reserved 1 KiB.
__device__ __forceinline__ uint32_t shared_window_address(const void* p FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  return ::fagen_emu::shared_window_address(p, FAGEN_CALL_SITE);
#else
  return shared_address(p);
#endif
}

__device__ __forceinline__ uint64_t make_smem_desc(uint32_t address, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                                   uint32_t swizzle, uint32_t base_offset = 0) {
  return static_cast<uint64_t>((address >> 4) & 0x3fffu) |
         static_cast<uint64_t>((lbo_bytes >> 4) & 0x3fffu) << 16 |
         static_cast<uint64_t>((sbo_bytes >> 4) & 0x3fffu) << 32 |
         static_cast<uint64_t>(base_offset & 0x7u) << 49 |
         static_cast<uint64_t>(swizzle & 0x3u) << 62;
}

// A descriptor moved `bytes` further into shared memory: the start address is its low field
// (address >> 4), so adding there is enough while the tiles stay below 256 KiB. A loop builds its
// descriptors once and only moves them (rebuilding them per k-step costs ~50 instructions).
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// `desc`, as a value the compiler must take to be new on each pass through a loop. A loop's
// descriptors that never change (a block's K and V tiles, read by every iteration) are otherwise
// hoisted out of it, with every step's offset added in advance: one 64-bit value per wgmma, more
// than the 63 uniform registers hold, so they land in per-thread registers, cost an R2UR pair per
// wgmma and, beside dK and dV's 128 accumulator registers, spill (the sm90 backward at d = 128).
// Taken afresh, each step's descriptor is one uniform add where the wgmma needs it. No
// instruction: an empty asm the compiler cannot see through (the emulator needs nothing).
__device__ __forceinline__ uint64_t fresh_desc(uint64_t desc) {
#ifndef FAGEN_EMULATE
  asm volatile("" : "+l"(desc));
#endif
  return desc;
}

// How many address bits (from bit 7 up) a swizzle mode XORs into bits 4 and up.
__device__ __forceinline__ uint32_t swizzle_bits(uint32_t swizzle) {
  return swizzle == kSwizzle128B ? 3u : swizzle == kSwizzle64B ? 2u : swizzle == kSwizzle32B ? 1u : 0u;
}

// The address a wgmma reads for the unswizzled shared-window address `address`.
__device__ __forceinline__ uint32_t swizzle_address(uint32_t address, uint32_t swizzle) {
  const uint32_t mask = (1u << swizzle_bits(swizzle)) - 1u;
  return address ^ (((address >> 7) & mask) << 4);
}

}  // namespace fagen
