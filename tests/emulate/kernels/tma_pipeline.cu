// A TMA pipeline in miniature (FlashAttention-3's layout): warpgroup 0's warp 0 loads 32 x 64
// fp16 tiles of x (128 B rows, swizzled 128B) through a ring of STAGES shared-memory stages with
// tma_load; warpgroup 1's 128 threads double each element into an output tile (same swizzle) that
// one of them stores with tma_store, and sum their elements in fp32 into a row of 128 floats
// that one thread adds into `sums` with bulk_reduce_add_f32 at the end. Block b takes tiles
// b * tiles .. (b + 1) * tiles - 1; x may end inside the last tile (its rows past x load as zero
// and are not stored).
// - full[s]: the producer's arrive.expect_tx of the tile's bytes, then the TMA's complete_tx;
// - empty[s]: one arrival per consumer warp once it has read the stage.
//
// `bug` plants one fault (tests/emulate/test_emulate_tma.py): 0 none; 1 consumers wait with the
// flipped parity; 2 a consumer warp releases its stage before reading it; 3 expect_tx announces 16
// bytes too few; 4 the output tile is rewritten before the store's wait_group.read; 5 no bulk wait
// before the block exits; 6 the store's coordinates swap rows and columns; 7 no fence.proxy.async
// between the consumers' writes of the output tile and the store; 8 no named barrier between them
// and the thread that stores it; 9 the producer refills a stage without waiting on its empty barrier.
#include <fagen/prelude.cuh>
#include <fagen/elect.cuh>
#include <fagen/mbarrier.cuh>
#include <fagen/named_barrier.cuh>
#include <fagen/proxy_fence.cuh>
#include <fagen/tma.cuh>

namespace {

constexpr int kStages = 2;
constexpr int kRows = 32, kCols = 64;             // a tile: 32 rows of 128 bytes
constexpr uint32_t kTileBytes = kRows * kCols * 2;
constexpr int kOutTile = kStages * kTileBytes;    // byte offset of the output tile
constexpr int kRowSums = kOutTile + kTileBytes;   // 128 floats
constexpr int kConsumers = 128;

// The byte offset of element (r, c) of a tile in shared memory under the 128B swizzle: the 16-byte
// chunk index XOR the row within its 8-row atom (the tile starts 1024-byte aligned).
__device__ int swizzled(int r, int c) {
  const int byte = r * 128 + c * 2;
  return (byte & ~0x70) | ((((byte >> 4) & 7) ^ (r & 7)) << 4);
}

__device__ void produce(const fagen::TensorMap& x_map, unsigned char* smem, uint64_t* full, uint64_t* empty,
                        int first, int tiles, int bug) {
  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages;
    const uint32_t round = static_cast<uint32_t>(i / kStages);
    if (bug != 9) fagen::mbarrier_wait_parity(&empty[s], (round & 1) ^ 1);
    if (fagen::elect_one_sync()) {
      fagen::mbarrier_arrive_expect_tx(&full[s], kTileBytes - (bug == 3 ? 16 : 0));
      const int coords[2] = {0, (first + i) * kRows};
      fagen::tma_load<2>(smem + s * kTileBytes, x_map, coords, &full[s]);
    }
    __syncwarp();
  }
}

__device__ void consume(const fagen::TensorMap& y_map, unsigned char* smem, float* sums, uint64_t* full,
                        uint64_t* empty, int first, int tiles, int bug) {
  const int t = static_cast<int>(threadIdx.x) - 128;
  auto* out = reinterpret_cast<__half*>(smem + kOutTile);
  float sum = 0.0f;
  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages;
    const uint32_t round = static_cast<uint32_t>(i / kStages);
    fagen::mbarrier_wait_parity(&full[s], (round & 1) ^ (bug == 1 ? 1u : 0u));
    if (bug == 2 && fagen::elect_one_sync()) fagen::mbarrier_arrive(&empty[s]);
    const auto* tile = reinterpret_cast<const __half*>(smem + s * kTileBytes);
    if (bug != 4 && t == 0 && i > 0) fagen::bulk_wait_group_read<0>();  // the last store has read `out`
    fagen::named_barrier_sync(1, kConsumers);
    for (int e = t; e < kRows * kCols; e += kConsumers) {
      const int r = e / kCols, c = e % kCols, at = swizzled(r, c) / 2;
      const float v = __half2float(tile[at]);
      sum += v;
      out[at] = __float2half(2.0f * v);
    }
    __syncwarp();
    if (bug != 2 && fagen::elect_one_sync()) fagen::mbarrier_arrive(&empty[s]);
    if (bug != 7) fagen::fence_proxy_async_shared();  // the generic-proxy writes of `out`, before the async proxy
    if (bug != 8) fagen::named_barrier_sync(1, kConsumers);   // reads it; then to the storing thread
    if (t == 0) {
      const int coords[2] = {0, (first + i) * kRows};
      const int swapped[2] = {(first + i) * kRows, 0};
      fagen::tma_store<2>(y_map, bug == 6 ? swapped : coords, out);
      fagen::bulk_commit_group();
    }
  }
  auto* row_sums = reinterpret_cast<float*>(smem + kRowSums);
  row_sums[t] = sum;
  fagen::fence_proxy_async_shared();
  fagen::named_barrier_sync(1, kConsumers);
  if (t == 0) {
    fagen::bulk_reduce_add_f32(sums, row_sums, kConsumers * 4);
    fagen::bulk_commit_group();
    if (bug != 5) fagen::bulk_wait_group<0>();
  }
}

}  // namespace

// 256 threads; dynamic shared memory: kStages tiles, the output tile, 128 floats.
extern "C" __global__ void tma_pipeline(const __grid_constant__ fagen::TensorMap x_map,
                                        const __grid_constant__ fagen::TensorMap y_map, float* sums, int tiles,
                                        int bug) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kStages];
  __shared__ __align__(8) uint64_t empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      fagen::mbarrier_init(&full[s], 1);
      fagen::mbarrier_init(&empty[s], kConsumers / 32);
    }
    fagen::mbarrier_init_fence();
  }
  __syncthreads();
  const int first = static_cast<int>(blockIdx.x) * tiles;
  if (threadIdx.x < 32) {
    produce(x_map, smem, full, empty, first, tiles, bug);
  } else if (threadIdx.x >= 128) {
    consume(y_map, smem, sums, full, empty, first, tiles, bug);
  }
}
FAGEN_EXPORT(tma_pipeline)
