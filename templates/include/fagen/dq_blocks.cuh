// dQ's fp32 accumulator in whole query blocks: the sm90 backward's `dq_blocks`, (B, H, padded Nq, d).
//
// A query block's kBlockM x d elements lie in the order in which the consumers' wgmma accumulators
// hold them, as FlashAttention-3's dQaccum does: each thread then stores its partial 16 bytes at a
// time, four consecutive accumulator registers, with no two lanes of a quarter-warp on one bank,
// and the dQ writer's bulk reduction adds the block as it lies. The conversion to dQ reads each
// element back through `dq_block_offset`.
//
// An m64nN fp32 accumulator (the PTX ISA's wgmma D fragment): thread t = 32 w + 4 g + q of the
// warpgroup holds register i = 4 j + e at row 16 w + g + 8 (e / 2), column 8 j + 2 q + e % 2.
// Its float4 j (registers 4 j .. 4 j + 3) goes to float4 128 j + t of the block's 64 rows; the next
// 64 rows (a 128-row block) follow, 64 d floats further.
#pragma once

#include <fagen/numeric.cuh>   // FAGEN_UNROLL

namespace fagen {

// Where element (row, col) of a query block lies in its kBlockM x kHeadDim of dq_blocks.
template <int kHeadDim>
__device__ __forceinline__ int dq_block_offset(int row, int col) {
  const int rows64 = row / 64, r = row % 64;
  const int t = 32 * (r / 16) + 4 * (r % 8) + col % 8 / 2;
  return rows64 * 64 * kHeadDim + 4 * (128 * (col / 8) + t) + 2 * (r % 16 / 8) + col % 2;
}

// An m64 x kCols fp32 accumulator of columns 8 j0 .. of the 64 rows at `rows` (the block's, or its
// second 64's): thread t's float4 j to float4 128 (j0 + j) + t.
template <int kCols>
__device__ __forceinline__ void store_dq_fragment(const float (&acc)[kCols / 2], float* rows, int j0, int t) {
  float4* at = reinterpret_cast<float4*>(rows) + 128 * j0 + t;
  FAGEN_UNROLL
  for (int j = 0; j < kCols / 8; ++j) {
    at[128 * j] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
  }
}

}  // namespace fagen
