// A prototype Hopper (sm_90a) attention forward, hand-written to prove that the twins compose
// (issue 29's de-risking): FlashAttention-3's warp-specialised layout without its later overlaps.
//   warpgroup 0    the producer: one warp loads Q once, then K and V tiles through a ring of
//                  kStages stages by TMA (128B swizzle), full[s] / empty[s] mbarriers per stage;
//                  setmaxnreg.dec to 24 registers.
//   warpgroups 1-2 two consumers, 64 query rows each: S = Q K^T by wgmma from shared memory, the
//                  online softmax in registers (exp2, the scale in log2 units), O += P V by wgmma
//                  with P from registers; setmaxnreg.inc to 240 registers.
// Non-causal, head dim 128, fp16 or bf16 in, fp32 accumulation; writes O (B, Nq, H, 128) and
// L = logsumexp (natural log, fp32, (B, H, Nq)). q (B, Nq, H, 128), k / v (B, Nk, H, 128), any
// Nq and Nk: TMA fills rows past a tensor with zeros; key columns past Nk are masked to -inf before
// the softmax and query rows past Nq are not stored. Grid (ceil(Nq / 128), H, B), 384 threads.
//
// Shared memory (dynamic, from a 1024-byte-aligned base, the 128B swizzle's period): Q (128 x 128),
// then per stage K and V (128 x 128 each). A 128 x 128 tile is two boxes of 128 rows x 64 columns
// (a 128-byte swizzle row each), 16 KiB apart: columns 0-63, then 64-127.
// The comments "FA2 line n" name the line of FlashAttention-2's Algorithm 1 a step implements.
#include <fagen/prelude.cuh>
#include <fagen/elect.cuh>
#include <fagen/mbarrier.cuh>
#include <fagen/numeric.cuh>
#include <fagen/smem_desc.cuh>
#include <fagen/tma.cuh>
#include <fagen/warpgroup_control.cuh>
#include <fagen/wgmma.cuh>

namespace {

constexpr int kStages = 2;
constexpr int kBlockM = 128, kBlockN = 128, kHeadDim = 128;
constexpr int kThreads = 384;
constexpr uint32_t kHalfBytes = 128 * 128;            // one box: 128 rows x 64 columns of 2 bytes
constexpr uint32_t kTileBytes = 2 * kHalfBytes;       // a 128 x 128 tile
constexpr uint32_t kQOffset = 0;
constexpr uint32_t kStageOffset = kTileBytes;         // stage s: K at + 2 s tiles, V one tile later
constexpr uint32_t kShared = kStageOffset + kStages * 2 * kTileBytes;
static_assert(kShared + 1024 <= 227 * 1024, "Q and the stages, with the alignment slack, fit sm_90's 227 KiB");

template <class T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

__device__ __forceinline__ uint32_t bits(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint32_t bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

// Two fp32 values as one register of the wgmma A fragment: the lower k in the low half.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return bits(fagen::from_float<T>(lo)) | bits(fagen::from_float<T>(hi)) << 16;
}

struct Barriers {
  uint64_t q_full;
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

// Loads one 128 x 128 tile (rows `row` .. row + 127 of head h, batch b) as its two 64-column boxes.
// A map's coordinates are innermost first: (column, head, row, batch) for a (B, N, H, d) tensor.
__device__ __forceinline__ void load_tile(unsigned char* dst, const fagen::TensorMap& map, int row, int h, int b,
                                          uint64_t* bar) {
  const int left[4] = {0, h, row, b}, right[4] = {64, h, row, b};
  fagen::tma_load<4>(dst, map, left, bar);
  fagen::tma_load<4>(dst + kHalfBytes, map, right, bar);
}

// FA2 lines 4 and 6 (load Q_i, then K_j, V_j for every j): the producer warp. A stage is refilled
// once its empty barrier says both consumers' eight warps are done with it.
__device__ void produce(const fagen::TensorMap& q_map, const fagen::TensorMap& k_map, const fagen::TensorMap& v_map,
                        unsigned char* tiles, Barriers* bars, int m_block, int h, int b, int n_tiles) {
  if (fagen::elect_one_sync()) {
    fagen::mbarrier_arrive_expect_tx(&bars->q_full, kTileBytes);
    load_tile(tiles + kQOffset, q_map, m_block * kBlockM, h, b, &bars->q_full);
  }
  __syncwarp();
  for (int j = 0; j < n_tiles; ++j) {
    const int s = j % kStages;
    const uint32_t round = static_cast<uint32_t>(j / kStages);
    fagen::mbarrier_wait_parity(&bars->empty[s], (round & 1) ^ 1);  // the first round's "previous phase"
    if (fagen::elect_one_sync()) {
      unsigned char* stage = tiles + kStageOffset + s * 2 * kTileBytes;
      fagen::mbarrier_arrive_expect_tx(&bars->full[s], 2 * kTileBytes);
      load_tile(stage, k_map, j * kBlockN, h, b, &bars->full[s]);
      load_tile(stage + kTileBytes, v_map, j * kBlockN, h, b, &bars->full[s]);
    }
    __syncwarp();
  }
}

// A descriptor moved `bytes` further into shared memory: the start address is the low field
// (address >> 4, 14 bits), so adding there is enough while the tiles stay below 256 KiB. The
// descriptors are built once, before the loop, and only moved in it: rebuilding them per k-step
// cost 49 more instructions per consumer iteration (fagen sass --cubin: 538 against 489).
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// FA2 line 8: S = Q K^T for this warpgroup's 64 rows, eight k16 steps over d = 128. Both operands
// are K-major under the 128B swizzle: 8 rows of 128 bytes per core-matrix group (SBO 1024), a k-step
// 32 bytes along the row within a box, steps 4-7 in the second box (the swizzle acts on the
// absolute address, so moving the start address is enough).
template <bool kBf16>
__device__ __forceinline__ void scores(float (&s)[kBlockN / 2], uint64_t q_desc, uint64_t k_desc) {
  fagen::wgmma_fence();
  FAGEN_UNROLL
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const uint32_t step = (kk / 4) * kHalfBytes + (kk % 4) * 32;
    fagen::wgmma_ss<kBlockN, kBf16>(s, advance(q_desc, step), advance(k_desc, step), kk > 0 ? 1 : 0);
  }
  fagen::wgmma_commit();
  fagen::wgmma_fence_operands<kBlockN>(s);
  fagen::wgmma_wait<0>();
  fagen::wgmma_fence_operands<kBlockN>(s);
}

// Columns at or past `valid` (keys past Nk, which TMA loaded as zeros) get -inf before the
// softmax. Register i holds column 8 (i / 4) + 2 q + i % 2 (the m64nNk16 D fragment).
__device__ __forceinline__ void mask_tail(float (&s)[kBlockN / 2], int valid, int quad) {
  FAGEN_UNROLL
  for (int i = 0; i < kBlockN / 2; ++i) {
    if (8 * (i / 4) + 2 * quad + i % 2 >= valid) s[i] = -fagen::infinity();
  }
}

// FA2 lines 9-10 in FA3's exp2 form: m_new = max(m, rowmax(S)); P = exp2(S log2(e) scale - m_new
// log2(e) scale) (one FFMA and one MUFU.EX2 per element); each thread's partial row sum l is
// rescaled and extended (the quad's four partial sums are added once, at the end). Register i is
// in row g + 8 ((i / 2) % 2); the four threads of a quad share a row. Returns the rescale factors
// exp2((m_old - m_new) log2(e) scale) for O. A row that has seen only -inf keeps offset 0.
__device__ __forceinline__ void online_softmax(float (&s)[kBlockN / 2], float (&m)[2], float (&l)[2],
                                               float (&rescale)[2], float scale_log2) {
  float top[2] = {m[0], m[1]};
  FAGEN_UNROLL
  for (int i = 0; i < kBlockN / 2; ++i) top[(i >> 1) & 1] = fmaxf(top[(i >> 1) & 1], s[i]);
  FAGEN_UNROLL
  for (int r = 0; r < 2; ++r) {
    top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 1));
    top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 2));
  }
  float offset[2], sum[2] = {0.f, 0.f};
  FAGEN_UNROLL
  for (int r = 0; r < 2; ++r) {
    offset[r] = top[r] == -fagen::infinity() ? 0.f : top[r] * scale_log2;
    rescale[r] = fagen::exp2_approx(m[r] * scale_log2 - offset[r]);
    m[r] = top[r];
  }
  FAGEN_UNROLL
  for (int i = 0; i < kBlockN / 2; ++i) {
    const int r = (i >> 1) & 1;
    s[i] = fagen::exp2_approx(s[i] * scale_log2 - offset[r]);
    sum[r] += s[i];
  }
  FAGEN_UNROLL
  for (int r = 0; r < 2; ++r) l[r] = l[r] * rescale[r] + sum[r];
}

// FA2 line 10's diag(exp(m_old - m_new)) O: the accumulator's rows are laid out as S's.
__device__ __forceinline__ void rescale_output(float (&o)[kHeadDim / 2], const float (&rescale)[2]) {
  FAGEN_UNROLL
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] *= rescale[(i >> 1) & 1];
}

// P (the S accumulator, fp32) as the A operand of P V from registers, in T. The k16 step kk takes
// keys 16 kk .. 16 kk + 15; A's register r holds A[16w + g + 8 (r % 2)][8 (r / 2) + 2q + {0, 1}],
// which is S's register 4 (2 kk + r / 2) + 2 (r % 2) + {0, 1} = 8 kk + 2 r + {0, 1}: the D
// fragment of m64nN and the A fragment of k16 share rows and column pairs (checked in the test
// against tests/support/isa_wgmma.py's tables).
template <class T>
__device__ __forceinline__ void probabilities_as_a(const float (&p)[kBlockN / 2], uint32_t (&a)[kBlockN / 16][4]) {
  FAGEN_UNROLL
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    FAGEN_UNROLL
    for (int r = 0; r < 4; ++r) a[kk][r] = pack2<T>(p[8 * kk + 2 * r], p[8 * kk + 2 * r + 1]);
  }
}

// FA2 line 10's + P V: O (64 x 128) += P (64 x 128 keys) V (128 keys x 128). V's tile is rows of
// keys, d contiguous: for B (K = keys, N = d) that is MN-major (imm-trans-b 1). Under the 128B
// swizzle an MN-major operand's core-matrix groups are 8 k of 128 bytes (SBO 1024 to the next 8
// keys) and LBO steps between 64-column boxes (16 KiB): one m64n128k16 spans both boxes. A k-step
// is 16 keys, 2048 bytes.
template <bool kBf16>
__device__ __forceinline__ void accumulate_pv(float (&o)[kHeadDim / 2], const uint32_t (&a)[kBlockN / 16][4],
                                              uint64_t v_desc) {
  fagen::wgmma_fence();
  FAGEN_UNROLL
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    fagen::wgmma_rs<kHeadDim, kBf16, 1>(o, a[kk], advance(v_desc, kk * 2048), 1);
  }
  fagen::wgmma_commit();
  fagen::wgmma_fence_operands<kHeadDim>(o);
  fagen::wgmma_wait<0>();
  fagen::wgmma_fence_operands<kHeadDim>(o);
}

// FA2 lines 12-13 and 15-16: O / l, L = m scale + log(l) (natural log); rows past Nq are not
// stored. Register i of O holds row 16w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2q + i % 2.
template <class T>
__device__ __forceinline__ void store(const float (&o)[kHeadDim / 2], const float (&m)[2], float (&l)[2], T* out,
                                      float* lse, int first_row, int nq, int heads, int h, int b, float scale,
                                      int g, int quad) {
  float inverse[2];
  FAGEN_UNROLL
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inverse[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
  FAGEN_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = first_row + g + 8 * r;
    if (row >= nq) continue;
    T* dst = out + ((static_cast<long long>(b) * nq + row) * heads + h) * kHeadDim;
    FAGEN_UNROLL
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const int i = 4 * j + 2 * r;
      *reinterpret_cast<uint32_t*>(dst + 8 * j + 2 * quad) = pack2<T>(o[i] * inverse[r], o[i + 1] * inverse[r]);
    }
    if (quad == 0) lse[(static_cast<long long>(b) * heads + h) * nq + row] = m[r] * scale + logf(l[r]);
  }
}

// FA2 lines 5-16 for one consumer warpgroup (64 query rows).
template <class T>
__device__ void consume(unsigned char* tiles, Barriers* bars, T* out, float* lse, int m_block, int h, int b,
                        int nq, int nk, int heads, int n_tiles, float scale, float scale_log2) {
  constexpr bool kBf16 = IsBf16<T>::value;
  // Read through a shuffle so that the compiler knows it is warp-uniform: the descriptors built from it
  // then live in uniform registers, not moved there (R2UR) before every wgmma (489 -> 460 per iteration).
  const int consumer = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128 - 1, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  const int warp = t / 32, g = t % 32 / 4, quad = t % 4;
  const uint32_t base = fagen::shared_window_address(tiles);
  // This warpgroup's 64 rows of Q; stage 0's K and V (K-major and MN-major B, see scores, accumulate_pv).
  const uint64_t q_desc = fagen::make_smem_desc(base + kQOffset + consumer * 64 * 128, 16, 1024, fagen::kSwizzle128B);
  const uint64_t k_desc = fagen::make_smem_desc(base + kStageOffset, 16, 1024, fagen::kSwizzle128B);
  const uint64_t v_desc =
      fagen::make_smem_desc(base + kStageOffset + kTileBytes, kHalfBytes, 1024, fagen::kSwizzle128B);
  float o[kHeadDim / 2], m[2] = {-fagen::infinity(), -fagen::infinity()}, l[2] = {0.f, 0.f};  // FA2 line 5
  FAGEN_UNROLL
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
  fagen::mbarrier_wait_parity(&bars->q_full, 0);
  for (int j = 0; j < n_tiles; ++j) {                                                      // FA2 line 6
    const int s = j % kStages;
    fagen::mbarrier_wait_parity(&bars->full[s], static_cast<uint32_t>(j / kStages) & 1);
    const uint32_t stage = s * 2 * kTileBytes;
    float p[kBlockN / 2];
    scores<kBf16>(p, q_desc, advance(k_desc, stage));
    if ((j + 1) * kBlockN > nk) mask_tail(p, nk - j * kBlockN, quad);
    float rescale[2];
    online_softmax(p, m, l, rescale, scale_log2);
    rescale_output(o, rescale);
    uint32_t a[kBlockN / 16][4];
    probabilities_as_a<T>(p, a);
    accumulate_pv<kBf16>(o, a, advance(v_desc, stage));
    __syncwarp();
    if (fagen::elect_one_sync()) fagen::mbarrier_arrive(&bars->empty[s]);  // this warp is done with K_j and V_j
  }
  store<T>(o, m, l, out, lse, m_block * kBlockM + consumer * 64 + 16 * warp, nq, heads, h, b, scale, g, quad);
}

template <class T>
__device__ void forward(const fagen::TensorMap& q_map, const fagen::TensorMap& k_map, const fagen::TensorMap& v_map,
                        T* out, float* lse, int nq, int nk, int heads, float scale, unsigned char* smem) {
  __shared__ Barriers bars;
  const uint32_t window = fagen::shared_window_address(smem);
  unsigned char* tiles = smem + (1024 - window % 1024) % 1024;   // the 128B swizzle repeats every 1024 bytes
  const int m_block = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int n_tiles = (nk + kBlockN - 1) / kBlockN;
  if (threadIdx.x == 0) {
    fagen::mbarrier_init(&bars.q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      fagen::mbarrier_init(&bars.full[s], 1);
      fagen::mbarrier_init(&bars.empty[s], 8);   // one arrival per consumer warp
    }
    fagen::mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    fagen::setmaxnreg_dec<24>();
    if (threadIdx.x < 32) produce(q_map, k_map, v_map, tiles, &bars, m_block, h, b, n_tiles);
  } else {
    fagen::setmaxnreg_inc<240>();
    consume<T>(tiles, &bars, out, lse, m_block, h, b, nq, nk, heads, n_tiles, scale, scale * fagen::kLog2e);
  }
}

}  // namespace

// Dynamic shared memory: kShared + 1024 (room to align the tiles to 1024 bytes).
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    hopper_forward_bf16(const __grid_constant__ fagen::TensorMap q_map, const __grid_constant__ fagen::TensorMap k_map,
                        const __grid_constant__ fagen::TensorMap v_map, __nv_bfloat16* out, float* lse, int nq,
                        int nk, int heads, float scale) {
  extern __shared__ __align__(1024) unsigned char smem[];
  forward<__nv_bfloat16>(q_map, k_map, v_map, out, lse, nq, nk, heads, scale, smem);
}
FAGEN_EXPORT(hopper_forward_bf16)

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    hopper_forward_fp16(const __grid_constant__ fagen::TensorMap q_map, const __grid_constant__ fagen::TensorMap k_map,
                        const __grid_constant__ fagen::TensorMap v_map, __half* out, float* lse, int nq, int nk,
                        int heads, float scale) {
  extern __shared__ __align__(1024) unsigned char smem[];
  forward<__half>(q_map, k_map, v_map, out, lse, nq, nk, heads, scale, smem);
}
FAGEN_EXPORT(hopper_forward_fp16)
