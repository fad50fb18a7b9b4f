// fagen/online_softmax.cuh — the online-softmax step on a warp's accumulators.
//
// Scores arrive raw (S = Q K^T); the softmax scale, folded with log2(e) into
// `scale_log2`, is applied inside the exponent, so each element costs one FFMA and
// one exp2: P~ = exp2(S * scale_log2 - m * scale_log2). The row max m is kept in raw
// score units (the scale is positive: ops rejects others), which is what lets the
// scale ride in the FFMA instead of a multiply of its own. Each thread holds two rows
// per 16-row tile (its group's row r and r + 8); index `half` = e / 2 picks which of
// the two an accumulator element e in 0..3 belongs to.
#pragma once

#include <fagen/numeric.cuh>
#include <fagen/warp_tile.cuh>

namespace fagen {

// The max used as the exponent's offset: a row that has seen only masked
// scores keeps max = -inf; using 0 there makes exp2(-inf - 0) = 0 instead of
// exp2(-inf + inf) = NaN.
__device__ __forceinline__ float safe_max(float row_max) {
  return row_max == -infinity() ? 0.f : row_max;
}

// FA-2 Algorithm 1, lines 9-10 for one K/V tile: new row max (raw units), P~ =
// exp2((S - m) * scale_log2) in place of S, per-thread partial row sums rescaled and
// extended (the quad is summed once at the end), and the rescale factor
// exp2((m_old - m_new) * scale_log2) that the caller applies to O (1 while the row has
// seen no key). The row max itself is kept exact across the quad.
template <int kRowTiles, int kKeyTiles>
__device__ __forceinline__ void online_softmax_step(float (&s)[kRowTiles][kKeyTiles][4],
                                                    float (&row_max)[kRowTiles][2],
                                                    float (&row_sum)[kRowTiles][2],
                                                    float (&rescale)[kRowTiles][2], float scale_log2) {
  FAGEN_UNROLL
  for (int rt = 0; rt < kRowTiles; ++rt) {
    FAGEN_UNROLL
    for (int half = 0; half < 2; ++half) {
      float tile_max = -infinity();
      FAGEN_UNROLL
      for (int nt = 0; nt < kKeyTiles; ++nt)
        tile_max = fmaxf(tile_max, fmaxf(s[rt][nt][2 * half], s[rt][nt][2 * half + 1]));
      const float new_max = fmaxf(row_max[rt][half], quad_max(tile_max));
      const float offset = safe_max(new_max) * scale_log2;
      rescale[rt][half] = row_max[rt][half] == -infinity() ? 1.f : exp2_approx(row_max[rt][half] * scale_log2 - offset);
      float tile_sum = 0.f;
      FAGEN_UNROLL
      for (int nt = 0; nt < kKeyTiles; ++nt) {
        FAGEN_UNROLL
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[rt][nt][e] = exp2_approx(fmaf(s[rt][nt][e], scale_log2, -offset));
          tile_sum += s[rt][nt][e];
        }
      }
      row_sum[rt][half] = row_sum[rt][half] * rescale[rt][half] + tile_sum;
      row_max[rt][half] = new_max;
    }
  }
}

// O = diag(rescale) O for the rows of each accumulator element.
template <int kRowTiles, int kDimTiles>
__device__ __forceinline__ void rescale_rows(float (&o)[kRowTiles][kDimTiles][4],
                                             const float (&rescale)[kRowTiles][2]) {
  FAGEN_UNROLL
  for (int rt = 0; rt < kRowTiles; ++rt)
    FAGEN_UNROLL
    for (int dt = 0; dt < kDimTiles; ++dt)
      FAGEN_UNROLL
      for (int e = 0; e < 4; ++e) o[rt][dt][e] *= rescale[rt][e / 2];
}

}  // namespace fagen
