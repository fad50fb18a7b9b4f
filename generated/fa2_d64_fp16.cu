// ============================================================================
// fagen generated kernel source: fa2_d64_fp16
//
// kernels:
//   fa2_d64_fp16_fwd  (128 threads, 55296 B shared memory)
//   fa2_d64_fp16_bwd_preprocess  (128 threads, 0 B shared memory)
//   fa2_d64_fp16_bwd  (256 threads, 93184 B shared memory)
//   fa2_d64_fp16_bwd_dq_convert  (128 threads, 0 B shared memory)
//
// spec:
//   head_dim       64
//   dtype          fp16
//   version        2
//   block_m        128
//   block_n        64
//   num_warps      4
//   num_stages     2
//   mask           none
//   key_padding    False
//   dropout        False
//   deterministic  False
//   bwd_stages     2
//   bwd_block_n    128
//
// Rendered from templates/ by fagen.codegen; do not edit by hand
// (`fagen build` rewrites it). Algorithm line labels refer to the
// FlashAttention (Dao et al. 2022) and FlashAttention-2 (Dao 2023) papers.
// ============================================================================
#include <fagen/prelude.cuh>
#include <fagen/numeric.cuh>
#include <fagen/warp_tile.cuh>
#include <fagen/tile_copy.cuh>
#include <fagen/global_reduce.cuh>
#include <fagen/online_softmax.cuh>

typedef __half elem_t;

// ---------------------------------------------------------------------------
// Forward: FlashAttention-2 (Dao 2023, Algorithm 1) on tensor cores.
// Per thread block: Q_i stays in shared memory; K_j, V_j stream through a
// 2-stage cp.async pipeline. Each warp owns 32 rows of Q_i and
// computes S = Q K^T and O += P V with mma.sync m16n8k16 (fp16 in, fp32
// accumulate), so no reduction crosses warps. O stays unscaled until one
// final rescale; the kernel writes O and L = m + log(l).
// ---------------------------------------------------------------------------

namespace fwd {

constexpr int kBlockM = 128;          // B_r: query rows per thread block
constexpr int kBlockN = 64;          // B_c: keys per K/V tile
constexpr int kHeadDim = 64;        // d
constexpr int kHeadDimPad = 64;      // d rounded up to the mma k (16)
constexpr int kRowElems = 72;     // padded shared-memory row (elements)
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kStages = 2;         // K/V pipeline depth
constexpr int kRowTiles = kBlockM / (16 * kWarps);  // 16-row mma tiles per warp
constexpr int kKeyTiles = kBlockN / 8;              // 8-key mma tiles per K/V tile
constexpr int kDimSteps = kHeadDimPad / 16;         // k-steps of S = Q K^T
constexpr int kDimTiles = kHeadDimPad / 8;          // 8-column tiles of O
constexpr int kStageElems = kBlockN * kRowElems;

}  // namespace fwd

extern "C" __global__ void __launch_bounds__(128, 1)
fa2_d64_fp16_fwd(
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
    float softmax_scale_log2,
    int head_offset,
    int batch_offset) {
  using namespace fwd;
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* q_tile = reinterpret_cast<elem_t*>(smem + 0);
  elem_t* k_stages = reinterpret_cast<elem_t*>(smem + 18432);
  elem_t* v_stages = reinterpret_cast<elem_t*>(smem + 36864);

  const int q_block = blockIdx.x;
  const int first_row = q_block * kBlockM;        // Q_i's first row in the sequence
  const int batch = batch_offset + blockIdx.z, head = head_offset + blockIdx.y;  // grid: (row blocks, heads, batch)
  const int kv_head = head / (heads / kv_heads);  // GQA/MQA: index the shared K/V head, never copy it
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row0 = warp * kRowTiles * 16;    // the warp's first row inside Q_i
  const int row0 = first_row + warp_row0;         // ... and in the whole sequence
  const int keys = seqlen_k;

  const elem_t* q_rows = q + batch * q_stride_b + head * q_stride_h + (long long)first_row * q_stride_n;
  const elem_t* k_head = k + batch * k_stride_b + kv_head * k_stride_h;
  const elem_t* v_head = v + batch * v_stride_b + kv_head * v_stride_h;

  // Keys this block visits. Causal (bottom-right aligned: row i sees key j iff
  // j <= i + keys - seqlen_q): every K/V tile past the last row's diagonal is
  // fully masked and skipped. From `unmasked_keys` on, a tile needs the mask.
  int key_limit = keys, unmasked_keys = keys;
  const int num_tiles = (key_limit + kBlockN - 1) / kBlockN;

  // FA-2 Algorithm 1, line 4: load Q_i from HBM to SRAM (it joins the first cp.async group).
  // Each thread's share of a tile copy is planned once (fagen/tile_copy.cuh); a K/V tile
  // then costs one source pointer per tensor.
  const fagen::TileCopy<kBlockM, kHeadDim, kHeadDimPad, kRowElems, kThreads> q_copy;
  q_copy.rows(q_tile, q_copy.source(q_rows, q_stride_n), q_stride_n, seqlen_q - first_row);
  const fagen::TileCopy<kBlockN, kHeadDim, kHeadDimPad, kRowElems, kThreads> kv_copy;
  // Tiles are fetched in order: this thread's sources for the next one advance by a whole
  // tile per fetch (a 64-bit add, where recomputing them would take a chain of multiplies).
  const elem_t* k_next = kv_copy.source(k_head, k_stride_n);
  const elem_t* v_next = kv_copy.source(v_head, v_stride_n);
  const long long k_tile_stride = kBlockN * k_stride_n, v_tile_stride = kBlockN * v_stride_n;
  int next_first = 0;  // the next tile's first key
  auto load_next_kv = [&](int stage) {
    kv_copy.rows(k_stages + stage * kStageElems, k_next, k_stride_n, keys - next_first);
    kv_copy.rows(v_stages + stage * kStageElems, v_next, v_stride_n, keys - next_first);
    k_next += k_tile_stride, v_next += v_tile_stride, next_first += kBlockN;
  };
  for (int stage = 0; stage < kStages - 1; ++stage) {  // pipeline prologue
    if (stage < num_tiles) load_next_kv(stage);
    fagen::cp_async_commit();
  }

  // FA-2 Algorithm 1, line 5: O_i = 0, l_i = 0, m_i = -inf (m in raw score units).
  float o[kRowTiles][kDimTiles][4];
  fagen::zero_fill(o);
  float row_max[kRowTiles][2], row_sum[kRowTiles][2];
  FAGEN_UNROLL
  for (int rt = 0; rt < kRowTiles; ++rt)
    FAGEN_UNROLL
    for (int half = 0; half < 2; ++half) row_max[rt][half] = -fagen::infinity(), row_sum[rt][half] = 0.f;

  // FA-2 Algorithm 1, line 6: for each K/V block j.
  for (int j = 0; j < num_tiles; ++j) {
    // FA-2 Algorithm 1, line 7: load K_j, V_j; tile j + kStages - 1 is fetched while tile j is used.
    if (j + kStages - 1 < num_tiles) load_next_kv((j + kStages - 1) % kStages);
    fagen::cp_async_commit();
    fagen::cp_async_wait<kStages - 1>();
    __syncthreads();
    const elem_t* k_tile = k_stages + (j % kStages) * kStageElems;
    const elem_t* v_tile = v_stages + (j % kStages) * kStageElems;

    // FA-2 Algorithm 1, line 8: S_ij = Q_i K_j^T (the scale tau joins the exponent below).
    float s[kRowTiles][kKeyTiles][4];
    fagen::zero_fill(s);
    fagen::warp_mma_abt<kRowTiles, kKeyTiles, kDimSteps, kRowElems>(s, q_tile, warp_row0, k_tile);
    if ((j + 1) * kBlockN > unmasked_keys) {  // only tiles crossing the diagonal or the key tail
      FAGEN_UNROLL
      for (int rt = 0; rt < kRowTiles; ++rt)
        FAGEN_UNROLL
        for (int nt = 0; nt < kKeyTiles; ++nt)
          FAGEN_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int col = j * kBlockN + nt * 8 + 2 * (lane % 4) + (e % 2);
            if (!(col < keys)) s[rt][nt][e] = -fagen::infinity();
          }
    }

    // FA-2 Algorithm 1, lines 9-10: m_new = max(m, rowmax(S)); P~ = exp(tau (S - m_new));
    // l = exp(tau (m - m_new)) l + rowsum(P~); O = diag(exp(tau (m - m_new))) O (unscaled by l).
    float rescale[kRowTiles][2];
    fagen::online_softmax_step(s, row_max, row_sum, rescale, softmax_scale_log2);
    fagen::rescale_rows(o, rescale);

    // FA-2 Algorithm 1, line 10: O_i += P~_ij V_j.
    fagen::warp_mma_pb<kRowTiles, kKeyTiles, kDimTiles, kRowElems>(o, s, v_tile, 0);
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  // Every copy has landed (with no K/V tile, Q's copies were never committed)
  // and every warp is past the loop before O is staged over the Q tile.
  fagen::cp_async_wait_all();
  __syncthreads();

  // FA-2 Algorithm 1, lines 12-13: the one final rescale O_i = diag(l_i)^-1 O_i (times 1/(1-p)
  // under dropout) and L_i = tau m_i + log(l_i).
  // A row that saw no key has l = 0: its output is 0 and L = +inf, so the
  // backward pass's exp(S - L) is exactly 0 there.
  FAGEN_UNROLL
  for (int rt = 0; rt < kRowTiles; ++rt) {
    FAGEN_UNROLL
    for (int half = 0; half < 2; ++half) {
      const float total = fagen::quad_sum(row_sum[rt][half]);
      const float inv = total > 0.f ? 1.f / total : 0.f;
      const int local_row = warp_row0 + rt * 16 + lane / 4 + half * 8;
      FAGEN_UNROLL
      for (int dt = 0; dt < kDimTiles; ++dt) {
        // Stage O in this warp's own rows of the Q tile, for 16-byte stores below.
        *reinterpret_cast<unsigned*>(q_tile + local_row * kRowElems + dt * 8 + 2 * (lane % 4)) =
            fagen::pack2<elem_t>(o[rt][dt][2 * half] * inv, o[rt][dt][2 * half + 1] * inv);
      }
      const int row = first_row + local_row;
      if (lane % 4 == 0 && row < seqlen_q) {
        lse[((long long)batch * heads + head) * seqlen_q + row] =
            total > 0.f ? row_max[rt][half] * (softmax_scale_log2 * fagen::kLn2) + logf(total) : fagen::infinity();
      }
    }
  }
  __syncthreads();
  // FA-2 Algorithm 1, line 14: write O_i to HBM, 16 bytes per thread per step.
  elem_t* out_rows = out + batch * o_stride_b + head * o_stride_h + (long long)first_row * o_stride_n;
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int chunk = threadIdx.x; chunk < kBlockM * kChunksPerRow; chunk += kThreads) {
    const int r = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
    if (first_row + r < seqlen_q) {
      *reinterpret_cast<fagen::Chunk16*>(out_rows + r * o_stride_n + col) =
          *reinterpret_cast<const fagen::Chunk16*>(q_tile + r * kRowElems + col);
    }
  }
}
FAGEN_EXPORT(fa2_d64_fp16_fwd)

// ---------------------------------------------------------------------------
// Backward: FlashAttention-2 (Dao 2023, Algorithm 2) / FlashAttention-1
// (Algorithm 4), on tensor cores. P is recomputed from the saved statistics
// (L = m + log l), never stored.
//
//   fa2_d64_fp16_bwd_preprocess  D_i = rowsum(dO_i * O_i) and the statistic in log2 units; zeroes the fp32 dQ accumulator
//   fa2_d64_fp16_bwd  one block per (K/V block j, batch*head): dK_j, dV_j, and dQ by fp32 atomics
//   fa2_d64_fp16_bwd_dq_convert  dQ = tau * dq_accum, converted to fp16
// ---------------------------------------------------------------------------

namespace bwd {

constexpr int kBlockM = 64;             // query rows per Q block
constexpr int kBlockN = 128;             // keys per K/V block
constexpr int kHeadDim = 64;
constexpr int kHeadDimPad = 64;    // d padded to whole mma steps per d slice
constexpr int kRowElems = 72;
constexpr int kDsRowElems = 72;      // dS^T rows are keys, its columns queries
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kStages = 2;           // Q / dO pipeline depth
constexpr int kDimSplit = 1;          // warps splitting d for dK, dV
constexpr int kKeyTiles = 1;          // 16-key mma tiles per warp
constexpr int kKeyGroups = kWarps / kDimSplit;      // warps splitting the keys
constexpr int kSliceCols = kHeadDimPad / kDimSplit; // dK / dV columns per warp
constexpr int kQueryTiles = kBlockM / 8;            // 8-query mma tiles of S^T
constexpr int kDimSteps = kHeadDimPad / 16;
constexpr int kSliceTiles = kSliceCols / 8;
constexpr int kQStageElems = kBlockM * kRowElems;
constexpr int kStatsStageFloats = 2 * kBlockM;      // per stage: L_i (log2 units), then D_i
static_assert(kKeyGroups * kKeyTiles * 16 == kBlockN, "the key groups cover the K/V block");
static_assert(kSliceCols % 16 == 0, "d slices are whole mma k-steps");
// dQ = dS K: the block_m x d tile in tasks of kDqRowTiles x 16 rows by kDqColTiles x 8
// columns, spread over the warps (codegen picks the shape with the fewest loads per mma).
constexpr int kDqRowTiles = 1, kDqColTiles = 4;
constexpr int kDqTaskRows = kBlockM / (16 * kDqRowTiles);
constexpr int kDqTasks = kDqTaskRows * (kHeadDimPad / (8 * kDqColTiles));
constexpr int kDqTasksPerWarp = (kDqTasks + kWarps - 1) / kWarps;

// The preprocess kernel writes D_i and the statistic in rows padded to whole Q blocks,
// so that the main kernel copies a Q block's with 16-byte cp.async and no tail test.
__device__ __forceinline__ int padded_rows(int seqlen_q) { return (seqlen_q + kBlockM - 1) / kBlockM * kBlockM; }

}  // namespace bwd

// Algorithm 4, line 4 / FA-2 Algorithm 2, line 4: D_i = rowsum(dO_i * O_i), in fp32, and
// the statistic in log2 units that turns S into P, P = exp2(tau log2(e) S - lse_log2).
// Rows that saw no key have L = +inf, so their P is exactly 0; pad rows past seqlen_q get
// lse_log2 = +inf and D = 0.
extern "C" __global__ void __launch_bounds__(128, 1)
fa2_d64_fp16_bwd_preprocess(
    const __half* __restrict__ out,
    const __half* __restrict__ dout,
    const float* __restrict__ lse,
    float* __restrict__ delta,
    float* __restrict__ lse_log2,
    float* __restrict__ dq_accum,
    int heads,
    int seqlen_q,
    long long o_stride_b,
    long long o_stride_n,
    long long o_stride_h,
    long long do_stride_b,
    long long do_stride_n,
    long long do_stride_h,
    int head_offset,
    int batch_offset) {
  using namespace bwd;
  const int batch = batch_offset + blockIdx.z, head = head_offset + blockIdx.y;  // grid: (row blocks, heads, batch)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long padded0 = ((long long)batch * heads + head) * padded_rows(seqlen_q);
  for (int r = warp; r < kBlockM; r += blockDim.x / 32) {  // this kernel has its own block size
    const int row = blockIdx.x * kBlockM + r;
    if (row >= seqlen_q) {
      if (lane == 0) delta[padded0 + row] = 0.f, lse_log2[padded0 + row] = fagen::infinity();
      continue;
    }
    const elem_t* o_row = out + batch * o_stride_b + (long long)row * o_stride_n + head * o_stride_h;
    const elem_t* do_row = dout + batch * do_stride_b + (long long)row * do_stride_n + head * do_stride_h;
    float partial = 0.f;
    for (int c = lane; c < kHeadDim; c += 32) partial += fagen::to_float(o_row[c]) * fagen::to_float(do_row[c]);
    for (int lanes = 16; lanes > 0; lanes /= 2) partial += __shfl_xor_sync(0xffffffffu, partial, lanes);
    const long long stat = ((long long)batch * heads + head) * seqlen_q + row;
    if (lane == 0) {
      delta[padded0 + row] = partial;
      lse_log2[padded0 + row] = lse[stat] * fagen::kLog2e;
    }
    for (int c = lane; c < kHeadDim; c += 32) dq_accum[stat * kHeadDim + c] = 0.f;  // dQ = 0 (line 5)
  }
}
FAGEN_EXPORT(fa2_d64_fp16_bwd_preprocess)

namespace bwd {

// Line 21's accumulation: a warp's dQ task (fp32 accumulators of kRows x 16 rows by
// kCols x 8 columns) added into dq_accum, two adjacent columns per reduction. `row_base`
// points at this lane's first element; `rows_left` counts the rows from this lane's first
// that exist (only a Q block past seqlen_q's end tests them), `col0` is the task's column.
template <int kRows, int kCols>
__device__ __forceinline__ void add_dq(const float (&dq)[kRows][kCols][4], float* row_base, bool full_block,
                                       int rows_left, int col0) {
  FAGEN_UNROLL
  for (int rt = 0; rt < kRows; ++rt)
    FAGEN_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = rt * 16 + half * 8;
      if (!full_block && r >= rows_left) continue;
      FAGEN_UNROLL
      for (int dt = 0; dt < kCols; ++dt) {
        if (kHeadDim != kHeadDimPad && col0 + dt * 8 >= kHeadDim) continue;  // only padded head dims test
        fagen::atomic_add_pair(row_base + r * kHeadDim + dt * 8, dq[rt][dt][2 * half], dq[rt][dt][2 * half + 1]);
      }
    }
}

}  // namespace bwd

extern "C" __global__ void __launch_bounds__(256, 1)
fa2_d64_fp16_bwd(
    const __half* __restrict__ q,
    const __half* __restrict__ k,
    const __half* __restrict__ v,
    const __half* __restrict__ dout,
    const float* __restrict__ lse_log2,
    const float* __restrict__ delta,
    float* __restrict__ dq_accum,
    __half* __restrict__ dk_out,
    __half* __restrict__ dv_out,
    float* __restrict__ dk_out_fp32,
    float* __restrict__ dv_out_fp32,
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
    long long do_stride_b,
    long long do_stride_n,
    long long do_stride_h,
    long long dk_stride_b,
    long long dk_stride_n,
    long long dk_stride_h,
    long long dv_stride_b,
    long long dv_stride_n,
    long long dv_stride_h,
    float softmax_scale,
    float softmax_scale_log2,
    int head_offset,
    int batch_offset) {
  using namespace bwd;
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* k_tile = reinterpret_cast<elem_t*>(smem + 0);
  elem_t* v_tile = reinterpret_cast<elem_t*>(smem + 18432);
  elem_t* q_stages = reinterpret_cast<elem_t*>(smem + 36864);
  elem_t* do_stages = reinterpret_cast<elem_t*>(smem + 55296);
  elem_t* ds_tile = reinterpret_cast<elem_t*>(smem + 73728);        // dS^T
  float* stats_stages = reinterpret_cast<float*>(smem + 92160);  // L_i (log2), D_i

  const int kv_block = blockIdx.x, n0 = kv_block * kBlockN;
  const int batch = batch_offset + blockIdx.z, head = head_offset + blockIdx.y;  // grid: (row blocks, heads, batch)
  const int kv_head = head / (heads / kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key_group = warp % kKeyGroups, slice = warp / kKeyGroups;
  const int key_row0 = key_group * kKeyTiles * 16;  // the warp's keys inside K_j
  const int col0 = slice * kSliceCols;             // ... and its columns of dK_j, dV_j
  const int keys = seqlen_k;
  const long long stat0 = ((long long)batch * heads + head) * seqlen_q;          // dq_accum's rows
  const long long padded0 = ((long long)batch * heads + head) * padded_rows(seqlen_q);  // lse_log2's, delta's

  // Algorithm 4, line 7: load K_j, V_j into SRAM; they stay there for the whole Q loop.
  // Each thread's share of a tile copy is planned once (fagen/tile_copy.cuh).
  const fagen::TileCopy<kBlockN, kHeadDim, kHeadDimPad, kRowElems, kThreads> kv_copy;
  kv_copy.rows(k_tile, kv_copy.source(k + batch * k_stride_b + kv_head * k_stride_h + n0 * k_stride_n, k_stride_n),
               k_stride_n, keys - n0);
  kv_copy.rows(v_tile, kv_copy.source(v + batch * v_stride_b + kv_head * v_stride_h + n0 * v_stride_n, v_stride_n),
               v_stride_n, keys - n0);

  // Causal: Q blocks that end before this block's diagonal see none of its keys.
  const int num_q_blocks = n0 < keys ? (seqlen_q + kBlockM - 1) / kBlockM : 0;
  int first_q_block = 0;
  const fagen::TileCopy<kBlockM, kHeadDim, kHeadDimPad, kRowElems, kThreads> q_copy;
  // Q blocks are fetched in order: this thread's sources for the next one advance by a
  // whole block per fetch (a 64-bit add, where recomputing them would take multiplies).
  int next_first = first_q_block * kBlockM;  // the next Q block's first row
  const elem_t* q_next = q_copy.source(q + batch * q_stride_b + head * q_stride_h + (long long)next_first * q_stride_n,
                                       q_stride_n);
  const elem_t* do_next = q_copy.source(
      dout + batch * do_stride_b + head * do_stride_h + (long long)next_first * do_stride_n, do_stride_n);
  const long long q_block_stride = kBlockM * q_stride_n, do_block_stride = kBlockM * do_stride_n;
  auto load_next_q_do = [&](int stage) {
    q_copy.rows(q_stages + stage * kQStageElems, q_next, q_stride_n, seqlen_q - next_first);
    q_copy.rows(do_stages + stage * kQStageElems, do_next, do_stride_n, seqlen_q - next_first);
    if (threadIdx.x < kBlockM / 2) {  // the statistics: kBlockM / 4 chunks of L_i, then as many of D_i
      const float* stat = threadIdx.x < kBlockM / 4 ? lse_log2 : delta;
      fagen::cp_async_16(stats_stages + stage * kStatsStageFloats + 4 * threadIdx.x,
                         stat + padded0 + next_first + 4 * (threadIdx.x % (kBlockM / 4)), 16);
    }
    q_next += q_block_stride, do_next += do_block_stride, next_first += kBlockM;
  };
  for (int stage = 0; stage < kStages - 1; ++stage) {
    if (first_q_block + stage < num_q_blocks) load_next_q_do(stage);
    fagen::cp_async_commit();
  }

  // Line 8: dK~_j = 0, dV~_j = 0 on chip.
  float dk[kKeyTiles][kSliceTiles][4], dv[kKeyTiles][kSliceTiles][4];
  fagen::zero_fill(dk);
  fagen::zero_fill(dv);

  // Line 9: for each Q block i.
  for (int q_block = first_q_block; q_block < num_q_blocks; ++q_block) {
    const int step = q_block - first_q_block;
    // Line 10: load Q_i, dO_i and the statistics (prefetched kStages - 1 blocks ahead).
    if (q_block + kStages - 1 < num_q_blocks) load_next_q_do((step + kStages - 1) % kStages);
    fagen::cp_async_commit();
    const int q0 = q_block * kBlockM;
    fagen::cp_async_wait<kStages - 1>();
    __syncthreads();
    const elem_t* q_tile = q_stages + (step % kStages) * kQStageElems;
    const elem_t* do_tile = do_stages + (step % kStages) * kQStageElems;
    const float* lse_tile = stats_stages + (step % kStages) * kStatsStageFloats;
    const float* delta_tile = lse_tile + kBlockM;

    // Line 11: S_ij = Q_i K_j^T, computed transposed: this warp's keys are the rows.
    float st[kKeyTiles][kQueryTiles][4];
    fagen::zero_fill(st);
    fagen::warp_mma_abt<kKeyTiles, kQueryTiles, kDimSteps, kRowElems>(st, k_tile, key_row0, q_tile);

    // Lines 12-13: mask, then P_ij = exp(tau S_ij - L_i) (FA-1: diag(l_i)^-1 exp(tau S_ij - m_i)).
    // A lane's accumulator element e of query tile qt is query qt * 8 + 2 (lane % 4) + e % 2:
    // the statistics of those two queries come as one 8-byte load.
    const bool needs_mask = n0 + kBlockN > keys;
    FAGEN_UNROLL
    for (int qt = 0; qt < kQueryTiles; ++qt) {
      const float2 lse_pair = *reinterpret_cast<const float2*>(lse_tile + qt * 8 + 2 * (lane % 4));
      FAGEN_UNROLL
      for (int kt = 0; kt < kKeyTiles; ++kt)
        FAGEN_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + key_row0 + kt * 16 + lane / 4 + (e / 2) * 8;      // key
          float p = fagen::exp2_approx(fmaf(st[kt][qt][e], softmax_scale_log2, e % 2 ? -lse_pair.y : -lse_pair.x));
          if (needs_mask && !(col < keys)) p = 0.f;
          st[kt][qt][e] = p;
        }
    }

    // Line 17: dP_ij = dO_i V_j^T (transposed: V_j dO_i^T).
    float dpt[kKeyTiles][kQueryTiles][4];
    fagen::zero_fill(dpt);
    fagen::warp_mma_abt<kKeyTiles, kQueryTiles, kDimSteps, kRowElems>(dpt, v_tile, key_row0, do_tile);

    // Lines 18-20: dP_ij = dP_ij * Z_ij; dS_ij = P_ij * (dP_ij - D_i).
    FAGEN_UNROLL
    for (int qt = 0; qt < kQueryTiles; ++qt) {
      const float2 delta_pair = *reinterpret_cast<const float2*>(delta_tile + qt * 8 + 2 * (lane % 4));
      FAGEN_UNROLL
      for (int kt = 0; kt < kKeyTiles; ++kt)
        FAGEN_UNROLL
        for (int e = 0; e < 4; ++e) {
          const float d_row = e % 2 ? delta_pair.y : delta_pair.x;
          dpt[kt][qt][e] = st[kt][qt][e] * (dpt[kt][qt][e] - d_row);  // dS^T
        }
    }

    // Lines 15-16: dV~_j += (P_ij * Z_ij)^T dO_i (1/(1-p) at the end);  line 22: dK~_j += dS_ij^T Q_i
    // (tau at the end).
    fagen::warp_mma_pb<kKeyTiles, kQueryTiles, kSliceTiles, kRowElems>(dv, st, do_tile, col0);
    fagen::warp_mma_pb<kKeyTiles, kQueryTiles, kSliceTiles, kRowElems>(dk, dpt, q_tile, col0);

    // Line 21: dQ_i += tau dS_ij K_j, accumulated across K/V blocks with fp32 atomics.
    // dS^T goes to shared memory as it is (two queries per 32-bit store); every warp then
    // reads whole query rows of dS from it with transposing loads. tau is applied by the
    // convert kernel.
    if (slice == 0) {
      // This lane's first element of dS^T; the others are compile-time offsets from it.
      unsigned* ds_lane = reinterpret_cast<unsigned*>(ds_tile + (key_row0 + lane / 4) * kDsRowElems + 2 * (lane % 4));
      FAGEN_UNROLL
      for (int kt = 0; kt < kKeyTiles; ++kt)
        FAGEN_UNROLL
        for (int qt = 0; qt < kQueryTiles; ++qt)
          FAGEN_UNROLL
          for (int half = 0; half < 2; ++half)
            ds_lane[((kt * 16 + half * 8) * kDsRowElems + qt * 8) / 2] =
                fagen::pack2<elem_t>(dpt[kt][qt][2 * half], dpt[kt][qt][2 * half + 1]);
    }
    __syncthreads();
    const bool full_block = q0 + kBlockM <= seqlen_q;
    FAGEN_UNROLL
    for (int i = 0; i < kDqTasksPerWarp; ++i) {
      const int task = warp + i * kWarps;
      if (kDqTasks % kWarps != 0 && task >= kDqTasks) continue;  // folded away when the tasks split evenly
      const int row_tile = (task % kDqTaskRows) * kDqRowTiles, col = (task / kDqTaskRows) * 8 * kDqColTiles;
      float dq[kDqRowTiles][kDqColTiles][4];
      fagen::zero_fill(dq);
      fagen::warp_mma_atb<kDqRowTiles, kDqColTiles, kBlockN / 16, kDsRowElems, kRowElems>(
          dq, ds_tile, row_tile * 16, k_tile, col);
      const int first_row = q0 + row_tile * 16 + lane / 4;  // this lane's first dQ row
      add_dq(dq, dq_accum + (stat0 + first_row) * kHeadDim + col + 2 * (lane % 4), full_block,
             seqlen_q - first_row, col);
    }
    // No barrier before the next step's refills: the one after the dS^T store above already
    // orders every read of Q_i, dO_i and the statistics, and dS^T is rewritten only after the
    // next step's first barrier (tests/test_barrier_mutations.py).
  }
  // No later step reads a copy: the loop's last wait landed every one (the groups it leaves
  // are empty), and a block with no Q block reads no shared memory. The wait stays so that
  // no thread exits with a cp.async in flight, which the PTX ISA does not define (the
  // emulator lands copies at exit, so a mutation cannot show it).
  fagen::cp_async_wait_all();

  // Line 24: write dK_j = tau * dK~_j and dV_j to HBM (per query head; the op
  // sums the heads that share a K/V head, from fp32 copies). Under dropout dV_j takes its
  // 1/(1-p) here.
  const float dv_scale = 1.f;
  const bool grads_fp32 = heads != kv_heads;
  FAGEN_UNROLL
  for (int kt = 0; kt < kKeyTiles; ++kt)
    FAGEN_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int key = n0 + key_row0 + kt * 16 + lane / 4 + half * 8;
      if (key >= seqlen_k) continue;
      const long long dk_row = batch * dk_stride_b + (long long)key * dk_stride_n + head * dk_stride_h;
      const long long dv_row = batch * dv_stride_b + (long long)key * dv_stride_n + head * dv_stride_h;
      FAGEN_UNROLL
      for (int dt = 0; dt < kSliceTiles; ++dt) {
        const int col = col0 + dt * 8 + 2 * (lane % 4);
        if (col >= kHeadDim) continue;
        fagen::store_pair(dk_out, dk_out_fp32, dk_row + col, grads_fp32, dk[kt][dt][2 * half] * softmax_scale,
                          dk[kt][dt][2 * half + 1] * softmax_scale);
        fagen::store_pair(dv_out, dv_out_fp32, dv_row + col, grads_fp32, dv[kt][dt][2 * half] * dv_scale,
                          dv[kt][dt][2 * half + 1] * dv_scale);
      }
    }
}
FAGEN_EXPORT(fa2_d64_fp16_bwd)

// dQ = tau * dq_accum, converted to fp16 (after every K/V block has added its part).
extern "C" __global__ void __launch_bounds__(128, 1)
fa2_d64_fp16_bwd_dq_convert(
    const float* __restrict__ dq_accum,
    __half* __restrict__ dq,
    int heads,
    int seqlen_q,
    long long dq_stride_b,
    long long dq_stride_n,
    long long dq_stride_h,
    float softmax_scale,
    int head_offset,
    int batch_offset) {
  using namespace bwd;
  const int batch = batch_offset + blockIdx.z, head = head_offset + blockIdx.y;  // grid: (row blocks, heads, batch)
  const long long stat0 = ((long long)batch * heads + head) * seqlen_q;
  for (int idx = threadIdx.x; idx < kBlockM * kHeadDim; idx += blockDim.x) {
    const int row = blockIdx.x * kBlockM + idx / kHeadDim, col = idx % kHeadDim;
    if (row >= seqlen_q) break;
    dq[batch * dq_stride_b + (long long)row * dq_stride_n + head * dq_stride_h + col] =
        fagen::from_float<elem_t>(dq_accum[(stat0 + row) * kHeadDim + col] * softmax_scale);
  }
}
FAGEN_EXPORT(fa2_d64_fp16_bwd_dq_convert)

