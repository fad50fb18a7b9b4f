// fagen/tile_copy.cuh — global -> shared tile copies with 16-byte cp.async, planned once.
//
// A tile is kRows rows of a head-major global tensor (rows row_stride elements apart,
// kHeadDim elements each) copied into a padded shared tile (rows of kRowElems). The
// kThreads threads split it into 16-byte chunks, kChunksPerRow per row. Thread t always
// copies column chunk t % kChunksPerRow of rows t / kChunksPerRow + i * kRowsPerPass, so
// its column, its first row and its shared offset are worked out once (TileCopy's
// constructor) and each tile costs one pointer per pass: no division, no modulo, no
// 64-bit multiply in the main loop. When kThreads is not a multiple of kChunksPerRow
// (head dims whose padded width is not a power of two), the last threads copy nothing.
//
// A chunk is kChunkElems elements: 8 of 2-byte elements, 16 of an 8-bit cache's bytes
// (fagen/fp8_cache.cuh), whose head dims are then multiples of 16.
//
// Columns past kHeadDim (padding up to kHeadDimPad) are zero-filled: the mma k-steps read
// them. `rows` zero-fills the rows at or past `valid_rows` and reads nothing there:
// src-size 0 reads no byte, so the address of such a chunk (past the tensor's end) is
// never dereferenced (CUTLASS's zfill copies rely on the same; the emulator checks that
// such a chunk reads nothing).
#pragma once

#include <fagen/cp_async.cuh>
#include <fagen/numeric.cuh>

namespace fagen {

template <int kRows, int kHeadDim, int kHeadDimPad, int kRowElems, int kThreads, int kChunkElems = 8>
struct TileCopy {
  static constexpr int kChunksPerRow = kHeadDimPad / kChunkElems;       // kChunkElems elements = 16 bytes
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
  static constexpr bool kAllThreads = kRowsPerPass * kChunksPerRow == kThreads;
  static constexpr bool kEvenPasses = kPasses * kRowsPerPass == kRows;  // every pass has kRowsPerPass rows
  static_assert(kHeadDimPad % kChunkElems == 0 && kRowsPerPass > 0, "a pass copies at least one row");

  int row;        // this thread's first row (>= kRowsPerPass: a thread with nothing to copy)
  int col;        // its column chunk's first element
  int src_col;    // ... in the global row (0 for a padding chunk, which reads nothing)
  int col_bytes;  // 16, or 0 for a padding chunk

  __device__ __forceinline__ TileCopy()
      : row(threadIdx.x / kChunksPerRow),
        col((threadIdx.x % kChunksPerRow) * kChunkElems),
        src_col(col < kHeadDim ? col : 0),
        col_bytes(col < kHeadDim ? 16 : 0) {}

  // This thread's source for a tile whose first row is `rows` (loop-invariant parts of
  // the address: compute it once per tensor and advance it by whole tiles).
  template <class T>
  __device__ __forceinline__ const T* source(const T* rows, long long row_stride) const {
    return rows + row * row_stride + src_col;
  }

  // Pass i of this thread exists (its row is inside the tile and the thread copies at all).
  __device__ __forceinline__ bool in_tile(int pass) const {
    if (kAllThreads && (kEvenPasses || pass + 1 < kPasses)) return true;  // folded at compile time
    return row + pass * kRowsPerPass < kRows && (kAllThreads || row < kRowsPerPass);
  }

  // A tile from `src` (from source()): rows at or past `valid_rows` (counted from the
  // tile's first row) are zeros. One code path for full and ragged tiles alike: a branch
  // between the two is if-converted by ptxas, which then issues both copies every time.
  template <class T>
  __device__ __forceinline__ void rows(T* tile, const T* src, long long row_stride, int valid_rows) const {
    T* dst = tile + row * kRowElems + col;
    const int rows_here = valid_rows - row;  // pass p copies iff p * kRowsPerPass < rows_here
    FAGEN_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      if (!in_tile(pass)) continue;
      const bool inside = pass * kRowsPerPass < rows_here;
      cp_async_16(dst + pass * kRowsPerPass * kRowElems, src + pass * (kRowsPerPass * row_stride),
                  inside ? col_bytes : 0);
    }
  }
};

}  // namespace fagen
