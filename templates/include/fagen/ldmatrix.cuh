// fagen/ldmatrix.cuh — warp-collective loads of 8x8 b16 matrices from shared
// memory into mma fragments:
//   ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16
//
// Every lane passes one row address (16 bytes, 16-byte aligned, in shared
// memory): lane 8k + r gives row r of matrix k. x1 reads the addresses of
// lanes 0-7, x2 of lanes 0-15, x4 of all 32; the other lanes' addresses are
// ignored, but all 32 lanes must call (warp-collective).
//
// Register k of lane l then holds two 16-bit elements, low half first
// (PTX ISA "Warp-level matrix load instruction: ldmatrix"):
//   plain:  M_k[l / 4][2 (l % 4)],  M_k[l / 4][2 (l % 4) + 1]
//   .trans: M_k[2 (l % 4)][l / 4],  M_k[2 (l % 4) + 1][l / 4]
// With matrices ordered (rows 0-7, cols 0-7), (rows 8-15, cols 0-7),
// (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) of a row-major 16x16 tile,
// x4 yields exactly the mma A fragment a[0..3] (fagen/mma.cuh); the lane's
// address is then &tile[lane % 16][8 * (lane / 16)].
//
// Emulated twin: fagen_emu::ldmatrix (fagen/emulate/src/tensor_core.cpp).
#pragma once

#include <fagen/prelude.cuh>

namespace fagen {

// A lane's row address as the loads below take it: a 32-bit offset in the shared window
// on the GPU (a host pointer in the emulator), plus a byte offset. Computing a lane's
// address once per tile and stepping it by compile-time byte offsets lets ptxas fold
// each step into the load's immediate, instead of recomputing a generic-to-shared
// conversion per load.
#ifdef FAGEN_EMULATE
typedef const unsigned char* smem_address_t;
__device__ __forceinline__ smem_address_t smem_address(const void* p) { return static_cast<const unsigned char*>(p); }
#else
typedef uint32_t smem_address_t;
__device__ __forceinline__ smem_address_t smem_address(const void* p) { return shared_address(p); }
#endif

__device__ __forceinline__ void ldmatrix_x4_at(uint32_t regs[4], smem_address_t row FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::ldmatrix(4, false, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(row)
               : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans_at(uint32_t regs[4], smem_address_t row FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::ldmatrix(4, true, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(row)
               : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x1(uint32_t regs[1], const void* row FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::ldmatrix(1, false, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(regs[0]) : "r"(shared_address(row)) : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t regs[2], const void* row FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::ldmatrix(2, false, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(regs[0]), "=r"(regs[1]) : "r"(shared_address(row)) : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t regs[4], const void* row FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::ldmatrix(4, false, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(shared_address(row))
               : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x1_trans(uint32_t regs[1], const void* row FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::ldmatrix(1, true, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(regs[0]) : "r"(shared_address(row)) : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t regs[2], const void* row FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::ldmatrix(2, true, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(regs[0]), "=r"(regs[1]) : "r"(shared_address(row)) : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t regs[4], const void* row FAGEN_CALL_SITE_PARAMS) {
#ifdef FAGEN_EMULATE
  ::fagen_emu::ldmatrix(4, true, regs, row, FAGEN_CALL_SITE);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(shared_address(row))
               : "memory");
#endif
}

}  // namespace fagen
