// fagen/warp_tile.cuh — a warp's tensor-core tile products and fragment plumbing.
//
// Everything here is fixed math, templated on the tile shape; the kernel
// templates decide the shapes. Conventions (PTX ISA, mma.m16n8k16, see
// fagen/mma.cuh, from the PTX ISA): lane = 4 * group + tig. An fp32 accumulator
// tile `float c[4]` of a 16x8 block holds rows (group, group, group+8,
// group+8) and columns (2*tig, 2*tig+1, 2*tig, 2*tig+1). Shared-memory tiles
// are row-major with a padded row of kRowElems elements, which keeps the eight
// row addresses of one ldmatrix phase in distinct banks.
#pragma once

#include <fagen/numeric.cuh>
#include <fagen/ldmatrix.cuh>
#include <fagen/mma.cuh>

namespace fagen {

// -- element packing -------------------------------------------------------

// Two fp32 values as one 32-bit register of two 16-bit elements (low = first),
// the operand format of mma.sync.
template <class T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}

// Two adjacent fp32 results to global memory at `at`: packed in T, or, where `in_fp32`, as
// floats into `out_fp32` (the backward's dK/dV under GQA, whose query heads the op sums in
// fp32 and rounds once, after the sum: rounding each head's part first loses up to an ulp
// per head of the group).
template <class T> __device__ __forceinline__ void store_pair(T* out, float* out_fp32, long long at, bool in_fp32,
                                                             float lo, float hi) {
  if (in_fp32) {
    out_fp32[at] = lo;
    out_fp32[at + 1] = hi;
  } else {
    *reinterpret_cast<unsigned*>(out + at) = pack2<T>(lo, hi);
  }
}

template <class T> __device__ __forceinline__ void mma_16x8x16(float c[4], const unsigned a[4],
                                                               const unsigned b[2]);
template <> __device__ __forceinline__ void mma_16x8x16<__half>(float c[4], const unsigned a[4],
                                                                const unsigned b[2]) {
  mma_m16n8k16_f16(c, a, b);
}
template <> __device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float c[4], const unsigned a[4],
                                                                       const unsigned b[2]) {
  mma_m16n8k16_bf16(c, a, b);
}

// -- reductions over the 4 lanes that share an accumulator row -------------

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// -- tile products -------------------------------------------------------------
//
// Three shapes cover every matmul of the forward and backward passes. All
// shared tiles are row-major with kRowElems elements per row; "rows" of the
// accumulator are the A rows a warp owns (kRowTiles tiles of 16 from a_row0).

// C[rt][nt] += A B^T: A (rows x K) and B (N x K) both row-major in shared
// memory, K = 16 * kKSteps. B's rows are the n index, so a plain ldmatrix of B
// already is mma's "col" operand. (S = Q K^T, dP = dO V^T, S^T = K Q^T, ...)
template <int kRowTiles, int kNTiles, int kKSteps, int kRowElems, class T>
__device__ __forceinline__ void warp_mma_abt(float (&c)[kRowTiles][kNTiles][4], const T* a_tile,
                                             int a_row0, const T* b_tile) {
  static_assert(kNTiles % 2 == 0, "n comes in pairs of 8-wide tiles");
  const int lane = threadIdx.x % 32, m = lane / 8;
  // A: x4 matrices rows 0-7|8-15 (lane % 16) x k 0-7|8-15 (lane / 16).
  const smem_address_t a_lane = smem_address(a_tile + (a_row0 + lane % 16) * kRowElems + (lane / 16) * 8);
  // B: x4 matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
  const smem_address_t b_lane = smem_address(b_tile + ((m / 2) * 8 + lane % 8) * kRowElems + (m % 2) * 8);
  FAGEN_UNROLL
  for (int ks = 0; ks < kKSteps; ++ks) {
    unsigned a[kRowTiles][4];
    FAGEN_UNROLL
    for (int rt = 0; rt < kRowTiles; ++rt)
      ldmatrix_x4_at(a[rt], a_lane + (rt * 16 * kRowElems + ks * 16) * sizeof(T));
    FAGEN_UNROLL
    for (int np = 0; np < kNTiles / 2; ++np) {
      unsigned b[4];
      ldmatrix_x4_at(b, b_lane + (np * 16 * kRowElems + ks * 16) * sizeof(T));
      FAGEN_UNROLL
      for (int rt = 0; rt < kRowTiles; ++rt) {
        mma_16x8x16<T>(c[rt][2 * np], a[rt], b);
        mma_16x8x16<T>(c[rt][2 * np + 1], a[rt], b + 2);
      }
    }
  }
}

// A lane's address for the B operand of mma_a_times_b: a row-major (K x N) shared tile read
// with ldmatrix .trans, which turns its rows (the k index) into mma's "col" layout. x4
// matrices: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
template <int kRowElems, class T>
__device__ __forceinline__ smem_address_t b_trans_lane(const T* b_tile, int b_col0) {
  const int lane = threadIdx.x % 32, m = lane / 8;
  return smem_address(b_tile + ((m % 2) * 8 + lane % 8) * kRowElems + b_col0 + (m / 2) * 8);
}

// One k-step of C[rt][nt] += A B: the A fragments (one 16x16 per row tile) are
// in registers, B's k-step ks comes from a row-major (K x N) shared tile through
// b_lane (b_trans_lane), two n-tiles per ldmatrix. The inner step of warp_mma_ab,
// warp_mma_atb and warp_mma_pb, which differ only in where A comes from.
template <int kRowTiles, int kNTiles, int kRowElems, class T>
__device__ __forceinline__ void mma_a_times_b(float (&c)[kRowTiles][kNTiles][4], const unsigned (&a)[kRowTiles][4],
                                              smem_address_t b_lane, int ks) {
  FAGEN_UNROLL
  for (int np = 0; np < kNTiles / 2; ++np) {
    unsigned b[4];
    ldmatrix_x4_trans_at(b, b_lane + (ks * 16 * kRowElems + np * 16) * sizeof(T));
    FAGEN_UNROLL
    for (int rt = 0; rt < kRowTiles; ++rt) {
      mma_16x8x16<T>(c[rt][2 * np], a[rt], b);
      mma_16x8x16<T>(c[rt][2 * np + 1], a[rt], b + 2);
    }
  }
}

// C[rt][nt] += A B: A (rows x K) row-major in shared memory (rows of
// kARowElems), B (K x N) row-major in shared memory (rows of kBRowElems) from
// column b_col0. (The deterministic dQ pass's tests.)
template <int kRowTiles, int kNTiles, int kKSteps, int kARowElems, int kBRowElems, class T>
__device__ __forceinline__ void warp_mma_ab(float (&c)[kRowTiles][kNTiles][4], const T* a_tile,
                                            int a_row0, const T* b_tile, int b_col0) {
  static_assert(kNTiles % 2 == 0, "n comes in pairs of 8-wide tiles");
  const int lane = threadIdx.x % 32;
  const smem_address_t a_lane = smem_address(a_tile + (a_row0 + lane % 16) * kARowElems + (lane / 16) * 8);
  const smem_address_t b_lane = b_trans_lane<kBRowElems>(b_tile, b_col0);
  FAGEN_UNROLL
  for (int ks = 0; ks < kKSteps; ++ks) {
    unsigned a[kRowTiles][4];
    FAGEN_UNROLL
    for (int rt = 0; rt < kRowTiles; ++rt)
      ldmatrix_x4_at(a[rt], a_lane + (rt * 16 * kARowElems + ks * 16) * sizeof(T));
    mma_a_times_b<kRowTiles, kNTiles, kBRowElems, T>(c, a, b_lane, ks);
  }
}

// C[rt][nt] += A B with A (rows x K) stored transposed, as a row-major (K x rows) shared
// tile (rows of kARowElems) whose columns from a_col0 are A's rows: ldmatrix .trans of
// its 8x8 blocks yields A's fragments. B (K x N) row-major from column b_col0. (dQ = dS K from the
// backward's dS^T tile.)
template <int kRowTiles, int kNTiles, int kKSteps, int kARowElems, int kBRowElems, class T>
__device__ __forceinline__ void warp_mma_atb(float (&c)[kRowTiles][kNTiles][4], const T* a_tile_t,
                                             int a_col0, const T* b_tile, int b_col0) {
  static_assert(kNTiles % 2 == 0, "n comes in pairs of 8-wide tiles");
  const int lane = threadIdx.x % 32, m = lane / 8;
  // x4 .trans matrices a0..a3 = (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15)
  // of the stored (k x m) tile: lane 8i + r points at stored row k = 8 (i / 2) + r, column m = 8 (i % 2).
  const smem_address_t a_lane = smem_address(a_tile_t + ((m / 2) * 8 + lane % 8) * kARowElems + a_col0 + (m % 2) * 8);
  const smem_address_t b_lane = b_trans_lane<kBRowElems>(b_tile, b_col0);
  FAGEN_UNROLL
  for (int ks = 0; ks < kKSteps; ++ks) {
    unsigned a[kRowTiles][4];
    FAGEN_UNROLL
    for (int rt = 0; rt < kRowTiles; ++rt)
      ldmatrix_x4_trans_at(a[rt], a_lane + (ks * 16 * kARowElems + rt * 16) * sizeof(T));
    mma_a_times_b<kRowTiles, kNTiles, kBRowElems, T>(c, a, b_lane, ks);
  }
}

// C[rt][nt] += P B with P in registers: P's fp32 accumulators (kRowTiles x
// kKTiles 16x8 tiles) are rounded to T, two adjacent C tiles making exactly
// one 16x16 A fragment, so P never goes through shared memory. B (K x N)
// row-major in shared memory from column b_col0. (O += P V, dV += P^T dO,
// dK += dS^T Q, dQ += dS K.)
template <int kRowTiles, int kKTiles, int kNTiles, int kRowElems, class T>
__device__ __forceinline__ void warp_mma_pb(float (&c)[kRowTiles][kNTiles][4],
                                            const float (&p)[kRowTiles][kKTiles][4], const T* b_tile,
                                            int b_col0) {
  static_assert(kNTiles % 2 == 0 && kKTiles % 2 == 0, "tiles come in pairs");
  const smem_address_t b_lane = b_trans_lane<kRowElems>(b_tile, b_col0);
  FAGEN_UNROLL
  for (int ks = 0; ks < kKTiles / 2; ++ks) {
    unsigned a[kRowTiles][4];
    FAGEN_UNROLL
    for (int rt = 0; rt < kRowTiles; ++rt) {
      a[rt][0] = pack2<T>(p[rt][2 * ks][0], p[rt][2 * ks][1]);
      a[rt][1] = pack2<T>(p[rt][2 * ks][2], p[rt][2 * ks][3]);
      a[rt][2] = pack2<T>(p[rt][2 * ks + 1][0], p[rt][2 * ks + 1][1]);
      a[rt][3] = pack2<T>(p[rt][2 * ks + 1][2], p[rt][2 * ks + 1][3]);
    }
    mma_a_times_b<kRowTiles, kNTiles, kRowElems, T>(c, a, b_lane, ks);
  }
}

template <int kRowTiles, int kCols>
__device__ __forceinline__ void zero_fill(float (&acc)[kRowTiles][kCols][4]) {
  FAGEN_UNROLL
  for (int rt = 0; rt < kRowTiles; ++rt)
    FAGEN_UNROLL
    for (int c = 0; c < kCols; ++c)
      FAGEN_UNROLL
      for (int e = 0; e < 4; ++e) acc[rt][c][e] = 0.f;
}

}  // namespace fagen
