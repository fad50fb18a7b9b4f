// A prototype Hopper (sm_90a) attention backward, hand-written as hopper_forward.cu is (issue 44's
// de-risking): FlashAttention-3's backward layout, one CTA per key block, without its later overlaps.
//   warpgroup 0    the producer: one warp loads K_j and V_j once, then for every query block i that
//                  can see the key block Q_i, dO_i, L_i and D_i by TMA into a ring of kStages
//                  stages, full[s] / empty[s] mbarriers per stage; setmaxnreg.dec to 24 registers.
//   warpgroups 1-2 two consumers, 64 of the block's 128 keys each (c = 0, 1): per query block
//                  S^T = K_c Q_i^T and dP^T = V_c dO_i^T by wgmma from shared memory,
//                  P^T = exp2(S^T scale log2(e) - L_log2), dS^T = P^T o (dP^T - D),
//                  dV_c += P^T dO_i and dK_c += dS^T Q_i by wgmma with A from registers, and
//                  dQ_i's partial dS_c K_c by wgmma from shared memory (dS^T stored there), added
//                  into the fp32 dq_accum by one thread's cp.reduce.async.bulk; setmaxnreg.inc to 240.
// Head dim 64, fp16 or bf16 in, fp32 accumulation, MHA, no dropout; non-causal or causal
// (bottom-right aligned: key j is visible to query i iff j <= i + Nk - Nq). Inputs q, dO
// (B, Nq, H, 64), k, v (B, Nk, H, 64); lse_log2 = lse log2(e) and delta = rowsum(dO o O), both fp32
// (B, H, Nq_pad) with Nq_pad = Nq rounded up to 64 (the padding is loaded, then masked). Outputs
// dk, dv (B, Nk, H, 64) in the input type (dk scaled by `scale`; rows past Nk not stored) and
// dq_accum (B, H, Nq_pad, 64) fp32, zeroed by the caller, which receives the unscaled dS K (the
// caller scales and casts it; rows past Nq receive zeros). Grid (ceil(Nk / 128), H, B), 384 threads.
//
// Shared memory (dynamic, from a 1024-byte-aligned base, the 128B swizzle's period). Every 16-bit
// tile is rows of 64 elements, one 128-byte swizzle row each (TMA's box (1, rows, 1, 64) with the
// 128B swizzle; dS^T written by the consumers through the same swizzle):
//   K (128 x 64) at 0, V (128 x 64) at 16 KiB;
//   stage s: Q_i (64 x 64) at 32 KiB + 16 KiB s, dO_i (64 x 64) 8 KiB later;
//   dS^T of consumer c (64 keys x 64 queries) at 64 KiB + 8 KiB c;
//   dQ's fp32 partial of consumer c (64 x 64, row-major) at 80 KiB + 16 KiB c;
//   stage s's L_log2 (64 floats) at 112 KiB + 512 s, its D 256 bytes later.
#include <fagen/prelude.cuh>
#include <fagen/elect.cuh>
#include <fagen/mbarrier.cuh>
#include <fagen/named_barrier.cuh>
#include <fagen/numeric.cuh>
#include <fagen/proxy_fence.cuh>
#include <fagen/smem_desc.cuh>
#include <fagen/tma.cuh>
#include <fagen/warpgroup_control.cuh>
#include <fagen/wgmma.cuh>

namespace {

constexpr int kStages = 2;
constexpr int kBlockM = 64, kBlockN = 128, kHeadDim = 64;   // query rows per step, keys per CTA
constexpr int kThreads = 384;
constexpr uint32_t kQTileBytes = kBlockM * kHeadDim * 2;         // 8 KiB
constexpr uint32_t kKTileBytes = kBlockN * kHeadDim * 2;         // 16 KiB
constexpr uint32_t kKOffset = 0, kVOffset = kKTileBytes;
constexpr uint32_t kStageOffset = 2 * kKTileBytes;               // stage s: Q at + 2 s Q tiles, dO one tile later
constexpr uint32_t kDsOffset = kStageOffset + kStages * 2 * kQTileBytes;
constexpr uint32_t kDqOffset = kDsOffset + 2 * kQTileBytes;
constexpr uint32_t kDqBytes = kBlockM * kHeadDim * 4;            // 16 KiB of fp32 per consumer
constexpr uint32_t kRowsOffset = kDqOffset + 2 * kDqBytes;       // stage s: L at + 512 s, D 256 later
constexpr uint32_t kRowBytes = kBlockM * 4;
constexpr uint32_t kShared = kRowsOffset + kStages * 2 * kRowBytes;
constexpr uint32_t kStageTx = 2 * kQTileBytes + 2 * kRowBytes;   // Q, dO, L, D
static_assert(kShared + 1024 <= 227 * 1024, "the tiles, with the alignment slack, fit sm_90's 227 KiB");
static_assert(kDsOffset % 1024 == 0 && kStageOffset % 1024 == 0, "wgmma's swizzled tiles sit on 1024 bytes");

template <class T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

__device__ __forceinline__ uint32_t bits(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint32_t bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

// Two fp32 values as one register of the wgmma A fragment (or one 4-byte store): the lower k in the low half.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return bits(fagen::from_float<T>(lo)) | bits(fagen::from_float<T>(hi)) << 16;
}

struct Barriers {
  uint64_t kv_full;
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

// The query blocks that can see key block n_block: [first, end). Causal: query i sees key j iff
// j <= i + nk - nq, so the block's first key 128 n is seen from row 128 n - (nk - nq) on.
__device__ __forceinline__ void query_blocks(int n_block, int nq, int nk, bool causal, int& first, int& end) {
  end = (nq + kBlockM - 1) / kBlockM;
  first = 0;
  if (causal) {
    const int row = n_block * kBlockN - (nk - nq);
    first = row <= 0 ? 0 : (row >= nq ? end : row / kBlockM);
  }
}

// The producer warp: K_j and V_j once, then Q_i, dO_i (boxes of 64 rows) and L_i, D_i (64 floats
// of a (B, H, Nq_pad) map) per query block. A stage is refilled once its empty barrier says both
// consumers' eight warps are done with it. A map's coordinates are innermost first: (column, head,
// row, batch) for a (B, N, H, d) tensor, (row, head, batch) for (B, H, Nq_pad).
__device__ void produce(const fagen::TensorMap& q_map, const fagen::TensorMap& k_map, const fagen::TensorMap& v_map,
                        const fagen::TensorMap& do_map, const fagen::TensorMap& lse_map,
                        const fagen::TensorMap& delta_map, unsigned char* tiles, Barriers* bars, int n_block, int h,
                        int b, int first, int end) {
  if (fagen::elect_one_sync()) {
    fagen::mbarrier_arrive_expect_tx(&bars->kv_full, 2 * kKTileBytes);
    const int kv[4] = {0, h, n_block * kBlockN, b};
    fagen::tma_load<4>(tiles + kKOffset, k_map, kv, &bars->kv_full);
    fagen::tma_load<4>(tiles + kVOffset, v_map, kv, &bars->kv_full);
  }
  __syncwarp();
  for (int i = first; i < end; ++i) {
    const int it = i - first, s = it % kStages;
    const uint32_t round = static_cast<uint32_t>(it / kStages);
    fagen::mbarrier_wait_parity(&bars->empty[s], (round & 1) ^ 1);  // the first round's "previous phase"
    if (fagen::elect_one_sync()) {
      unsigned char* stage = tiles + kStageOffset + s * 2 * kQTileBytes;
      unsigned char* rows = tiles + kRowsOffset + s * 2 * kRowBytes;
      fagen::mbarrier_arrive_expect_tx(&bars->full[s], kStageTx);
      const int qo[4] = {0, h, i * kBlockM, b}, lr[3] = {i * kBlockM, h, b};
      fagen::tma_load<4>(stage, q_map, qo, &bars->full[s]);
      fagen::tma_load<4>(stage + kQTileBytes, do_map, qo, &bars->full[s]);
      fagen::tma_load<3>(rows, lse_map, lr, &bars->full[s]);
      fagen::tma_load<3>(rows + kRowBytes, delta_map, lr, &bars->full[s]);
    }
    __syncwarp();
  }
}

// A descriptor moved `bytes` further into shared memory (the start address field, address >> 4).
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// D (64 x 64) = A B over d = 64 with both operands K-major under the 128B swizzle (rows of 64
// elements, 128 bytes; SBO 1024 to the next 8 rows): four k16 steps, 32 bytes apart along the row.
// S^T = K_c Q^T (A = K_c's rows, B = Q's rows) and dP^T = V_c dO^T.
template <bool kBf16>
__device__ __forceinline__ void product_over_d(float (&d)[32], uint64_t a_desc, uint64_t b_desc) {
  FAGEN_UNROLL
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    fagen::wgmma_ss<64, kBf16>(d, advance(a_desc, kk * 32), advance(b_desc, kk * 32), kk > 0 ? 1 : 0);
  }
}

// The m64n64 accumulator as A fragments of k16 steps over its columns: A register r of step kk is
// accumulator registers 8 kk + 2 r, + 1 (the forward's probabilities_as_a; the D fragment of
// m64nN and the A fragment of k16 share rows and column pairs).
template <class T>
__device__ __forceinline__ void as_a(const float (&acc)[32], uint32_t (&a)[4][4]) {
  FAGEN_UNROLL
  for (int kk = 0; kk < 4; ++kk) {
    FAGEN_UNROLL
    for (int r = 0; r < 4; ++r) a[kk][r] = pack2<T>(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
  }
}

// P^T and dS^T for this warpgroup's 64 keys and the query block's 64 queries, in place: s holds
// S^T (unscaled), dp dP^T. Register i is key 16 w + g + 8 ((i / 2) % 2) of the warpgroup's keys,
// query 8 (i / 4) + 2 quad + i % 2 of the block; L and D are per query (a column), read from the
// stage. Keys past Nk, queries past Nq and (causal) keys a query cannot see get P = dS = 0.
__device__ __forceinline__ void probabilities_and_dscores(float (&s)[32], float (&dp)[32], const float* lse_log2,
                                                          const float* delta, int key0, int query0, int nq, int nk,
                                                          bool causal, float scale_log2, int quad) {
  FAGEN_UNROLL
  for (int i = 0; i < 32; ++i) {
    const int col = 8 * (i / 4) + 2 * quad + i % 2;
    const int key = key0 + 8 * ((i / 2) % 2), query = query0 + col;
    const bool visible = key < nk && query < nq && (!causal || key <= query + nk - nq);
    const float p = visible ? fagen::exp2_approx(s[i] * scale_log2 - lse_log2[col]) : 0.f;
    s[i] = p;
    dp[i] = p * (dp[i] - delta[col]);
  }
}

// dS^T into shared memory as the A operand of dQ = dS K read MN-major (imm-trans-a 1): row k (a
// key) of 128 bytes holds the 64 queries (M) contiguous, swizzled 128B on the absolute address;
// SBO 1024 steps 8 keys. A register r of step kk is keys 16 w + g + 8 (r % 2) (of the warpgroup's
// 64, the dS^T rows), queries 16 kk + 8 (r / 2) + 2 quad, + 1: one 4-byte store each.
__device__ __forceinline__ void store_ds(const uint32_t (&ds)[4][4], unsigned char* tile, uint32_t tile_window,
                                         int warp, int g, int quad) {
  FAGEN_UNROLL
  for (int kk = 0; kk < 4; ++kk) {
    FAGEN_UNROLL
    for (int r = 0; r < 4; ++r) {
      const uint32_t key = 16 * warp + g + 8 * (r % 2), query = 16 * kk + 8 * (r / 2) + 2 * quad;
      const uint32_t address = fagen::swizzle_address(tile_window + key * 128 + query * 2, fagen::kSwizzle128B);
      *reinterpret_cast<uint32_t*>(tile + (address - tile_window)) = ds[kk][r];
    }
  }
}

// The m64n64 fp32 accumulator dQ (rows = queries, columns = d) into a row-major 64 x 64 tile.
__device__ __forceinline__ void store_dq(const float (&dq)[32], float* tile, int warp, int g, int quad) {
  FAGEN_UNROLL
  for (int i = 0; i < 32; i += 2) {
    const int row = 16 * warp + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * quad;
    *reinterpret_cast<float2*>(tile + row * kHeadDim + col) = make_float2(dq[i], dq[i + 1]);
  }
}

// dK (scaled) and dV of this warpgroup's keys to global memory; rows past Nk are not stored.
template <class T>
__device__ __forceinline__ void store_dkdv(const float (&dk)[32], const float (&dv)[32], T* dk_out, T* dv_out,
                                           int key0, int nk, int heads, int h, int b, float scale, int quad) {
  FAGEN_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= nk) continue;
    const long long row = (static_cast<long long>(b) * nk + key) * heads + h;
    FAGEN_UNROLL
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const int i = 4 * j + 2 * r, col = 8 * j + 2 * quad;
      *reinterpret_cast<uint32_t*>(dk_out + row * kHeadDim + col) = pack2<T>(dk[i] * scale, dk[i + 1] * scale);
      *reinterpret_cast<uint32_t*>(dv_out + row * kHeadDim + col) = pack2<T>(dv[i], dv[i + 1]);
    }
  }
}

// One consumer warpgroup: 64 keys (c = 0, 1) of the block, every query block from `first` on.
template <class T>
__device__ void consume(unsigned char* tiles, Barriers* bars, T* dk_out, T* dv_out, float* dq_accum, int n_block,
                        int h, int b, int nq, int nk, int nq_pad, int heads, int first, int end, bool causal,
                        float scale, float scale_log2) {
  constexpr bool kBf16 = IsBf16<T>::value;
  // Read through a shuffle so that the compiler knows it is warp-uniform (uniform descriptors).
  const int consumer = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128 - 1, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  const int warp = t / 32, g = t % 32 / 4, quad = t % 4;
  const uint32_t base = fagen::shared_window_address(tiles);
  const uint32_t mine = consumer * 64 * 128;   // this warpgroup's 64 rows of K and V
  // K-major operands (S^T, dP^T): K_c, V_c as A, Q_i, dO_i as B. MN-major ones (rows of k, the 64
  // M or N elements contiguous; LBO would step 64-element columns, of which there is one): Q_i, dO_i
  // as B of dK, dV; dS^T as A and K_c as B of dQ. A k16 step of an MN-major operand is 16 rows, 2048 bytes.
  const uint64_t k_desc = fagen::make_smem_desc(base + kKOffset + mine, 16, 1024, fagen::kSwizzle128B);
  const uint64_t v_desc = fagen::make_smem_desc(base + kVOffset + mine, 16, 1024, fagen::kSwizzle128B);
  const uint64_t q_desc = fagen::make_smem_desc(base + kStageOffset, 16, 1024, fagen::kSwizzle128B);
  const uint64_t q_mn_desc = fagen::make_smem_desc(base + kStageOffset, kQTileBytes, 1024, fagen::kSwizzle128B);
  const uint64_t k_mn_desc = fagen::make_smem_desc(base + kKOffset + mine, kQTileBytes, 1024, fagen::kSwizzle128B);
  const uint32_t ds_window = base + kDsOffset + consumer * kQTileBytes;
  const uint64_t ds_desc = fagen::make_smem_desc(ds_window, kQTileBytes, 1024, fagen::kSwizzle128B);
  unsigned char* ds_tile = tiles + kDsOffset + consumer * kQTileBytes;
  float* dq_tile = reinterpret_cast<float*>(tiles + kDqOffset + consumer * kDqBytes);
  const int key0 = n_block * kBlockN + consumer * 64 + 16 * warp + g;   // this thread's first key
  const uint32_t sync_id = 1 + consumer;                                // the warpgroup's named barrier
  float dk[32], dv[32];
  FAGEN_UNROLL
  for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.f;
  fagen::mbarrier_wait_parity(&bars->kv_full, 0);
  for (int i = first; i < end; ++i) {
    const int it = i - first, s = it % kStages;
    fagen::mbarrier_wait_parity(&bars->full[s], static_cast<uint32_t>(it / kStages) & 1);
    const uint32_t stage = s * 2 * kQTileBytes;
    const float* rows = reinterpret_cast<const float*>(tiles + kRowsOffset + s * 2 * kRowBytes);
    // S^T = K_c Q_i^T and dP^T = V_c dO_i^T, two groups: the softmax of S^T overlaps dP^T's group.
    float st[32], dpt[32];
    fagen::wgmma_fence();
    product_over_d<kBf16>(st, k_desc, advance(q_desc, stage));
    fagen::wgmma_commit();
    product_over_d<kBf16>(dpt, v_desc, advance(q_desc, stage + kQTileBytes));
    fagen::wgmma_commit();
    fagen::wgmma_fence_operands<64>(st);
    fagen::wgmma_wait<1>();
    fagen::wgmma_fence_operands<64>(st);
    fagen::wgmma_fence_operands<64>(dpt);
    fagen::wgmma_wait<0>();
    fagen::wgmma_fence_operands<64>(dpt);
    probabilities_and_dscores(st, dpt, rows, rows + kBlockM, key0, i * kBlockM, nq, nk, causal, scale_log2, quad);
    uint32_t pa[4][4], dsa[4][4];
    as_a<T>(st, pa);
    as_a<T>(dpt, dsa);
    // dS^T to shared memory for dQ, before the wgmma that reads dsa is issued (its A registers may
    // not be touched, read included, until the wait that retires it). The previous block's dQ
    // wgmma read this tile; every thread retired it (wait<0>) before the barrier that ended that block.
    store_ds(dsa, ds_tile, ds_window, warp, g, quad);
    // dV_c += P^T dO_i and dK_c += dS^T Q_i: A from registers, B (dO_i, Q_i) MN-major.
    fagen::wgmma_fence();
    FAGEN_UNROLL
    for (int kk = 0; kk < 4; ++kk) {
      fagen::wgmma_rs<64, kBf16, 1>(dv, pa[kk], advance(q_mn_desc, stage + kQTileBytes + kk * 2048), 1);
    }
    FAGEN_UNROLL
    for (int kk = 0; kk < 4; ++kk) fagen::wgmma_rs<64, kBf16, 1>(dk, dsa[kk], advance(q_mn_desc, stage + kk * 2048), 1);
    fagen::wgmma_commit();
    fagen::wgmma_fence_fragments<4>(pa);    // pa and dsa stay in their registers until the wait
    fagen::wgmma_fence_fragments<4>(dsa);
    fagen::wgmma_fence_operands<64>(dv);
    fagen::wgmma_fence_operands<64>(dk);
    fagen::wgmma_wait<0>();
    fagen::wgmma_fence_operands<64>(dv);
    fagen::wgmma_fence_operands<64>(dk);
    fagen::wgmma_fence_fragments<4>(pa);
    fagen::wgmma_fence_fragments<4>(dsa);
    __syncwarp();
    if (fagen::elect_one_sync()) fagen::mbarrier_arrive(&bars->empty[s]);   // this warp is done with the stage
    // The previous block's reduction has read the dQ tile before anyone rewrites it (the issuing
    // thread's wait, then the barrier); dS^T's stores are visible to wgmma's async proxy.
    if (t == 0) fagen::bulk_wait_group_read<0>();
    fagen::fence_proxy_async_shared();
    fagen::named_barrier_sync(sync_id, 128);
    // dQ_i's partial (64 queries x 64) = dS_c K_c: A = dS MN-major from the tile, B = K_c MN-major.
    float dq[32];
    fagen::wgmma_fence();
    FAGEN_UNROLL
    for (int kk = 0; kk < 4; ++kk) {
      fagen::wgmma_ss<64, kBf16, 1, 1>(dq, advance(ds_desc, kk * 2048), advance(k_mn_desc, kk * 2048),
                                       kk > 0 ? 1 : 0);
    }
    fagen::wgmma_commit();
    fagen::wgmma_fence_operands<64>(dq);
    fagen::wgmma_wait<0>();
    fagen::wgmma_fence_operands<64>(dq);
    store_dq(dq, dq_tile, warp, g, quad);
    fagen::fence_proxy_async_shared();   // the tile's stores, visible to the bulk reduction's async proxy
    fagen::named_barrier_sync(sync_id, 128);
    if (t == 0) {
      float* dst = dq_accum + ((static_cast<long long>(b) * heads + h) * nq_pad + i * kBlockM) * kHeadDim;
      fagen::bulk_reduce_add_f32(dst, dq_tile, kDqBytes);
      fagen::bulk_commit_group();
    }
  }
  if (t == 0) fagen::bulk_wait_group<0>();   // the last reduction done before the CTA exits
  store_dkdv<T>(dk, dv, dk_out, dv_out, key0, nk, heads, h, b, scale, quad);
}

template <class T>
__device__ void backward(const fagen::TensorMap& q_map, const fagen::TensorMap& k_map, const fagen::TensorMap& v_map,
                         const fagen::TensorMap& do_map, const fagen::TensorMap& lse_map,
                         const fagen::TensorMap& delta_map, T* dk, T* dv, float* dq_accum, int nq, int nk, int heads,
                         int causal, float scale, unsigned char* smem) {
  __shared__ Barriers bars;
  const uint32_t window = fagen::shared_window_address(smem);
  unsigned char* tiles = smem + (1024 - window % 1024) % 1024;   // the 128B swizzle repeats every 1024 bytes
  const int n_block = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int nq_pad = (nq + kBlockM - 1) / kBlockM * kBlockM;
  int first, end;
  query_blocks(n_block, nq, nk, causal != 0, first, end);
  if (threadIdx.x == 0) {
    fagen::mbarrier_init(&bars.kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      fagen::mbarrier_init(&bars.full[s], 1);
      fagen::mbarrier_init(&bars.empty[s], 8);   // one arrival per consumer warp
    }
    fagen::mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    fagen::setmaxnreg_dec<24>();
    if (threadIdx.x < 32) {
      produce(q_map, k_map, v_map, do_map, lse_map, delta_map, tiles, &bars, n_block, h, b, first, end);
    }
  } else {
    fagen::setmaxnreg_inc<240>();
    consume<T>(tiles, &bars, dk, dv, dq_accum, n_block, h, b, nq, nk, nq_pad, heads, first, end, causal != 0, scale,
               scale * fagen::kLog2e);
  }
}

}  // namespace

// Dynamic shared memory: kShared + 1024 (room to align the tiles to 1024 bytes).
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    hopper_backward_bf16(const __grid_constant__ fagen::TensorMap q_map, const __grid_constant__ fagen::TensorMap k_map,
                         const __grid_constant__ fagen::TensorMap v_map,
                         const __grid_constant__ fagen::TensorMap do_map,
                         const __grid_constant__ fagen::TensorMap lse_map,
                         const __grid_constant__ fagen::TensorMap delta_map, __nv_bfloat16* dk, __nv_bfloat16* dv,
                         float* dq_accum, int nq, int nk, int heads, int causal, float scale) {
  extern __shared__ __align__(1024) unsigned char smem[];
  backward<__nv_bfloat16>(q_map, k_map, v_map, do_map, lse_map, delta_map, dk, dv, dq_accum, nq, nk, heads, causal,
                          scale, smem);
}
FAGEN_EXPORT(hopper_backward_bf16)

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    hopper_backward_fp16(const __grid_constant__ fagen::TensorMap q_map, const __grid_constant__ fagen::TensorMap k_map,
                         const __grid_constant__ fagen::TensorMap v_map,
                         const __grid_constant__ fagen::TensorMap do_map,
                         const __grid_constant__ fagen::TensorMap lse_map,
                         const __grid_constant__ fagen::TensorMap delta_map, __half* dk, __half* dv, float* dq_accum,
                         int nq, int nk, int heads, int causal, float scale) {
  extern __shared__ __align__(1024) unsigned char smem[];
  backward<__half>(q_map, k_map, v_map, do_map, lse_map, delta_map, dk, dv, dq_accum, nq, nk, heads, causal, scale,
                   smem);
}
FAGEN_EXPORT(hopper_backward_fp16)
