// ============================================================================
// fagen generated kernel source: fa2_d128_causal_fp16
// kernel: forward, SIMPLE kernel (fp32 math on CUDA cores, no tensor cores)
// The simple reference kernel of the foundation issue: correct, not fast.
//
// spec:
//   head_dim       128
//   dtype          fp16
//   version        2
//   block_m        128
//   block_n        32
//   num_warps      4
//   num_stages     2
//   mask           causal
//   key_padding    False
//   dropout        False
//   deterministic  False
//
// Rendered from templates/ by fagen.codegen; do not edit by hand
// (`fagen build` rewrites it). Algorithm line labels refer to the
// FlashAttention (Dao et al. 2022) and FlashAttention-2 (Dao 2023) papers.
// ============================================================================
//
// One thread block per (query block, batch*head). The Q tile is staged in
// shared memory; the block walks the K/V tiles in lockstep (they are shared),
// while each warp owns one query row at a time: lane l scores keys l, l+32,
// ... of the tile, and accumulates output columns l, l+32, ... of its row.
#include <fagen/prelude.cuh>
#include <fagen/numeric.cuh>

typedef __half elem_t;

namespace {

constexpr int kBlockM = 128;       // B_r: query rows per thread block
constexpr int kBlockN = 32;       // B_c: keys per K/V tile
constexpr int kHeadDim = 128;     // d
constexpr int kWarps = 4;
constexpr int kRowElems = 136;  // padded shared-memory row
constexpr int kKeysPerLane = (kBlockN + 31) / 32;
constexpr int kColsPerLane = (kHeadDim + 31) / 32;
constexpr unsigned kFullWarp = 0xffffffffu;

__device__ __forceinline__ float warp_max(float x) {
  for (int lanes = 16; lanes > 0; lanes /= 2) x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, lanes));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int lanes = 16; lanes > 0; lanes /= 2) x += __shfl_xor_sync(kFullWarp, x, lanes);
  return x;
}

// Copy `rows` rows of one head into a padded shared tile; rows past `valid`
// are zero so that ragged tails never read out of bounds.
__device__ __forceinline__ void load_tile(elem_t* tile, const elem_t* base, long long row_stride,
                                          int first_row, int valid, int rows) {
  for (int idx = threadIdx.x; idx < rows * kHeadDim; idx += blockDim.x) {
    const int r = idx / kHeadDim, c = idx % kHeadDim;
    const int row = first_row + r;
    tile[r * kRowElems + c] =
        row < valid ? base[(long long)row * row_stride + c] : fagen::from_float<elem_t>(0.f);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128)
fa2_d128_causal_fp16_fwd(
    const __half* __restrict__ q,
    const __half* __restrict__ k,
    const __half* __restrict__ v,
    __half* __restrict__ out,
    float* __restrict__ lse,
    int heads,
    int kv_heads,
    int seqlen_q,
    int seqlen_k,
    long long q_stride_b,
    long long q_stride_n,
    long long q_stride_h,
    long long k_stride_b,
    long long k_stride_n,
    long long k_stride_h,
    long long v_stride_b,
    long long v_stride_n,
    long long v_stride_h,
    long long o_stride_b,
    long long o_stride_n,
    long long o_stride_h,
    float softmax_scale_log2) {
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* q_tile = reinterpret_cast<elem_t*>(smem + 0);
  elem_t* k_tile = reinterpret_cast<elem_t*>(smem + 34816);
  elem_t* v_tile = reinterpret_cast<elem_t*>(smem + 52224);

  const int q_block = blockIdx.x;
  const int batch = blockIdx.y / heads, head = blockIdx.y % heads;
  const int kv_head = head / (heads / kv_heads);  // GQA: query heads share a K/V head
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int keys = seqlen_k;

  const elem_t* q_head = q + batch * q_stride_b + head * q_stride_h;
  const elem_t* k_head = k + batch * k_stride_b + kv_head * k_stride_h;
  const elem_t* v_head = v + batch * v_stride_b + kv_head * v_stride_h;

  // Algorithm 1, line 8 / FA-2 Algorithm 1, line 4: load Q_i into SRAM.
  load_tile(q_tile, q_head + (long long)q_block * kBlockM * q_stride_n, q_stride_n, 0,
            seqlen_q - q_block * kBlockM, kBlockM);

  // Keys this block needs at all. Causal (bottom-right aligned): query row i
  // sees key j iff j <= i + keys - seqlen_q, so K/V tiles past the block's
  // last row's diagonal are skipped entirely.
  int block_keys = keys;
  block_keys = min(keys, max(0, (q_block + 1) * kBlockM + keys - seqlen_q));

  for (int r0 = 0; r0 < kBlockM; r0 += kWarps) {
    const int r = r0 + warp;
    const int row = q_block * kBlockM + r;
    int row_keys = keys;  // keys this row may see
    row_keys = min(keys, max(0, row + 1 + keys - seqlen_q));

    // FA-2 Algorithm 1, line 5: O = 0, l = 0, m = -inf (m in log2 units).
    float row_max = -fagen::infinity(), row_sum = 0.f;
    float acc[kColsPerLane];
    for (int c = 0; c < kColsPerLane; ++c) acc[c] = 0.f;

    for (int n0 = 0; n0 < block_keys; n0 += kBlockN) {
      // Line 6-7: load K_j, V_j into SRAM (all warps share the tile).
      __syncthreads();
      load_tile(k_tile, k_head + (long long)n0 * k_stride_n, k_stride_n, 0, keys - n0, kBlockN);
      load_tile(v_tile, v_head + (long long)n0 * v_stride_n, v_stride_n, 0, keys - n0, kBlockN);
      __syncthreads();

      // Line 8: S_ij = tau * Q_i K_j^T, kept in log2 units (tau * log2(e) folded in).
      float score[kKeysPerLane];
      float tile_max = -fagen::infinity();
      for (int t = 0; t < kKeysPerLane; ++t) {
        const int key_in_tile = lane + 32 * t;
        float dot = 0.f;
        if (key_in_tile < kBlockN) {
          for (int c = 0; c < kHeadDim; ++c)
            dot += fagen::to_float(q_tile[r * kRowElems + c]) *
                   fagen::to_float(k_tile[key_in_tile * kRowElems + c]);
        }
        const bool visible = key_in_tile < kBlockN && n0 + key_in_tile < row_keys;
        score[t] = visible ? dot * softmax_scale_log2 : -fagen::infinity();
        tile_max = fmaxf(tile_max, score[t]);
      }
      // Line 9: m_new = max(m, rowmax(S_ij)); P~_ij = exp(S_ij - m_new).
      const float new_max = fmaxf(row_max, warp_max(tile_max));
      if (new_max == -fagen::infinity()) continue;  // nothing visible yet: no NaN from inf - inf
      float prob[kKeysPerLane];
      float tile_sum = 0.f;
      for (int t = 0; t < kKeysPerLane; ++t) {
        prob[t] = exp2f(score[t] - new_max);
        tile_sum += prob[t];
      }
      // Line 9: l_new = exp(m - m_new) l + rowsum(P~_ij); O = diag(exp(m - m_new)) O + P~ V.
      const float rescale = exp2f(row_max - new_max);
      row_sum = row_sum * rescale + warp_sum(tile_sum);
      for (int c = 0; c < kColsPerLane; ++c) acc[c] *= rescale;
      for (int j = 0; j < kBlockN; ++j) {
        const float p = __shfl_sync(kFullWarp, prob[j / 32], j % 32);
        for (int c = 0; c < kColsPerLane; ++c) {
          const int col = lane + 32 * c;
          if (col < kHeadDim) acc[c] += p * fagen::to_float(v_tile[j * kRowElems + col]);
        }
      }
      row_max = new_max;
    }

    if (row < seqlen_q) {
      // FA-2 Algorithm 1, line 12: O_i = diag(l)^-1 O_i. A row that sees no
      // key has l = 0: its output is 0, not 0/0.
      const float inv_sum = row_sum > 0.f ? 1.f / row_sum : 0.f;
      elem_t* out_row = out + batch * o_stride_b + (long long)row * o_stride_n + head * o_stride_h;
      for (int c = 0; c < kColsPerLane; ++c) {
        const int col = lane + 32 * c;
        if (col < kHeadDim) out_row[col] = fagen::from_float<elem_t>(acc[c] * inv_sum);
      }
      if (lane == 0) {
        const long long stat = ((long long)batch * heads + head) * seqlen_q + row;
        // Line 13: L_i = m_i + log(l_i), natural log; +inf marks a row with no key,
        // so the backward pass's exp(S - L) is exactly 0 there.
        lse[stat] = row_sum > 0.f ? row_max * fagen::kLn2 + logf(row_sum) : fagen::infinity();
      }
    }
  }
}
FAGEN_EXPORT(fa2_d128_causal_fp16_fwd)
