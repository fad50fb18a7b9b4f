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
#include <fagen/cp_async.cuh>
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

// -- global -> shared copies -------------------------------------------------

// Copy rows [0, kRows) of a head-major global tile into a padded shared tile
// with 16-byte cp.async, kThreads threads cooperating. Rows at or past
// `valid_rows` and columns past kHeadDim (padding up to kHeadDimPad) are
// zero-filled (src-size 0), reading nothing: ragged tails never touch memory
// out of bounds. `safe` is any valid global address, used as the dummy
// source of zero-filled chunks.
template <int kRows, int kHeadDim, int kHeadDimPad, int kRowElems, int kThreads, class T>
__device__ __forceinline__ void copy_tile_async(T* tile, const T* rows, long long row_stride,
                                                int valid_rows, const T* safe) {
  constexpr int kChunksPerRow = kHeadDimPad / 8;  // 8 elements = 16 bytes
  for (int chunk = threadIdx.x; chunk < kRows * kChunksPerRow; chunk += kThreads) {
    const int r = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
    const bool inside = r < valid_rows && col < kHeadDim;
    const T* src = inside ? rows + r * row_stride + col : safe;
    cp_async_16(tile + r * kRowElems + col, src, inside ? 16 : 0);
  }
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
  const int lane = threadIdx.x % 32;
  FAGEN_UNROLL
  for (int ks = 0; ks < kKSteps; ++ks) {
    unsigned a[kRowTiles][4];
    FAGEN_UNROLL
    for (int rt = 0; rt < kRowTiles; ++rt) {
      // x4 matrices: rows 0-7|8-15 (lane % 16) x k 0-7|8-15 (lane / 16).
      ldmatrix_x4(a[rt], a_tile + (a_row0 + rt * 16 + lane % 16) * kRowElems + ks * 16 + (lane / 16) * 8);
    }
    FAGEN_UNROLL
    for (int np = 0; np < kNTiles / 2; ++np) {
      // x4 matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
      const int m = lane / 8;
      unsigned b[4];
      ldmatrix_x4(b, b_tile + (np * 16 + (m / 2) * 8 + lane % 8) * kRowElems + ks * 16 + (m % 2) * 8);
      FAGEN_UNROLL
      for (int rt = 0; rt < kRowTiles; ++rt) {
        mma_16x8x16<T>(c[rt][2 * np], a[rt], b);
        mma_16x8x16<T>(c[rt][2 * np + 1], a[rt], b + 2);
      }
    }
  }
}

// The B operand for k-step ks and n-tiles (2 np, 2 np + 1) from a row-major
// (K x N) shared tile: ldmatrix .trans turns its rows (the k index) into
// mma's "col" layout. x4 matrices: (k 0-7, n 0-7), (k 8-15, n 0-7),
// (k 0-7, n 8-15), (k 8-15, n 8-15).
template <int kRowElems, class T>
__device__ __forceinline__ void load_b_trans(unsigned (&b)[4], const T* b_tile, int ks, int n0) {
  const int lane = threadIdx.x % 32, m = lane / 8;
  ldmatrix_x4_trans(b, b_tile + (ks * 16 + (m % 2) * 8 + lane % 8) * kRowElems + n0 + (m / 2) * 8);
}

// One k-step of C[rt][nt] += A B: the A fragments (one 16x16 per row tile) are
// in registers, B's k-step ks comes from a row-major (K x N) shared tile from
// column b_col0, two n-tiles per ldmatrix. The inner step of warp_mma_ab and
// warp_mma_pb, which differ only in where A comes from.
template <int kRowTiles, int kNTiles, int kRowElems, class T>
__device__ __forceinline__ void mma_a_times_b(float (&c)[kRowTiles][kNTiles][4], const unsigned (&a)[kRowTiles][4],
                                              const T* b_tile, int ks, int b_col0) {
  FAGEN_UNROLL
  for (int np = 0; np < kNTiles / 2; ++np) {
    unsigned b[4];
    load_b_trans<kRowElems>(b, b_tile, ks, b_col0 + np * 16);
    FAGEN_UNROLL
    for (int rt = 0; rt < kRowTiles; ++rt) {
      mma_16x8x16<T>(c[rt][2 * np], a[rt], b);
      mma_16x8x16<T>(c[rt][2 * np + 1], a[rt], b + 2);
    }
  }
}

// C[rt][nt] += A B: A (rows x K) row-major in shared memory (rows of
// kARowElems), B (K x N) row-major in shared memory (rows of kBRowElems) from
// column b_col0. (dQ = dS K in the backward.)
template <int kRowTiles, int kNTiles, int kKSteps, int kARowElems, int kBRowElems, class T>
__device__ __forceinline__ void warp_mma_ab(float (&c)[kRowTiles][kNTiles][4], const T* a_tile,
                                            int a_row0, const T* b_tile, int b_col0) {
  static_assert(kNTiles % 2 == 0, "n comes in pairs of 8-wide tiles");
  const int lane = threadIdx.x % 32;
  FAGEN_UNROLL
  for (int ks = 0; ks < kKSteps; ++ks) {
    unsigned a[kRowTiles][4];
    FAGEN_UNROLL
    for (int rt = 0; rt < kRowTiles; ++rt)
      ldmatrix_x4(a[rt], a_tile + (a_row0 + rt * 16 + lane % 16) * kARowElems + ks * 16 + (lane / 16) * 8);
    mma_a_times_b<kRowTiles, kNTiles, kBRowElems>(c, a, b_tile, ks, b_col0);
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
    mma_a_times_b<kRowTiles, kNTiles, kRowElems>(c, a, b_tile, ks, b_col0);
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
