// A warp-specialised pipeline in miniature (FlashAttention-3's layout): warpgroup 0
// is the producer (its warp 0 copies tiles; warps 1-3 only lower their register
// budget and exit), warpgroup 1's four warps consume. Tiles pass through a ring
// of STAGES shared-memory stages guarded by two mbarriers per stage:
// - full[s]: one arrival (the producer's elected lane, with arrive.expect_tx for
//   the tile's bytes) plus the tile's bytes (mbarrier.complete_tx once the warp
//   has written them, as a TMA copy would deliver them);
// - empty[s]: one arrival per consumer warp (its elected lane, once the warp has
//   read the stage).
// Round r of stage s waits full[s] with parity r & 1 and empty[s] with parity
// (r & 1) ^ 1 (the producer's first pass finds every stage empty).
// y[i][c] = tile i's element c: the data must arrive intact through every phase.
//
// `bug` plants one fault (tests/emulate/test_emulate_mbarrier.py): 0 none;
// 1 consumers wait with the flipped parity; 2 a consumer warp releases its stage
// before reading it; 3 expect_tx announces 16 bytes too many; 4 empty[s] expects
// one arrival too many; 5 one too few; 6 no fence.mbarrier_init; 7 the producer
// delivers the bytes (complete_tx) before writing them; 8 the producer refills a stage
// without waiting on its empty barrier.
#include <fagen/prelude.cuh>
#include <fagen/elect.cuh>
#include <fagen/mbarrier.cuh>
#include <fagen/warpgroup_control.cuh>

namespace {

constexpr int kStages = 2;
constexpr int kTile = 128;           // floats per tile: one per consumer thread
constexpr int kConsumerWarps = 4;
constexpr uint32_t kTileBytes = kTile * 4;

__device__ void produce(const float* x, float* ring, uint64_t* full, uint64_t* empty, int tiles, int bug) {
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages;
    const uint32_t round = static_cast<uint32_t>(i / kStages);
    if (bug != 8) fagen::mbarrier_wait_parity(&empty[s], (round & 1) ^ 1);
    if (fagen::elect_one_sync()) {
      fagen::mbarrier_arrive_expect_tx(&full[s], kTileBytes + (bug == 3 ? 16 : 0));
      if (bug == 7) fagen::mbarrier_complete_tx(&full[s], kTileBytes);
    }
    __syncwarp();
    for (int k = lane; k < kTile; k += 32) ring[s * kTile + k] = x[i * kTile + k];
    __syncwarp();
    __threadfence_block();  // the warp's stores before the relaxed complete_tx
    if (fagen::elect_one_sync() && bug != 7) fagen::mbarrier_complete_tx(&full[s], kTileBytes);
  }
}

__device__ void consume(const float* ring, float* y, uint64_t* full, uint64_t* empty, int tiles, int bug) {
  const int c = static_cast<int>(threadIdx.x) - 128;
  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages;
    const uint32_t round = static_cast<uint32_t>(i / kStages);
    fagen::mbarrier_wait_parity(&full[s], (round & 1) ^ (bug == 1 ? 1u : 0u));
    if (bug == 2 && fagen::elect_one_sync()) fagen::mbarrier_arrive(&empty[s]);
    y[i * kTile + c] = ring[s * kTile + c];
    __syncwarp();
    if (bug != 2 && fagen::elect_one_sync()) fagen::mbarrier_arrive(&empty[s]);
  }
}

}  // namespace

// 256 threads: warpgroup 0 produces, warpgroup 1 consumes.
extern "C" __global__ void mbarrier_pipeline(const float* x, float* y, int tiles, int bug) {
  __shared__ __align__(16) float ring[kStages * kTile];
  __shared__ __align__(8) uint64_t full[kStages];
  __shared__ __align__(8) uint64_t empty[kStages];
  if (threadIdx.x == 0) {
    const int arrivals = kConsumerWarps + (bug == 4 ? 1 : 0) - (bug == 5 ? 1 : 0);
    for (int s = 0; s < kStages; ++s) {
      fagen::mbarrier_init(&full[s], 1);
      fagen::mbarrier_init(&empty[s], static_cast<uint32_t>(arrivals));
    }
    if (bug != 6) fagen::mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    fagen::setmaxnreg_dec<24>();
    if (threadIdx.x < 32) produce(x, ring, full, empty, tiles, bug);
  } else {
    fagen::setmaxnreg_inc<240>();
    consume(ring, y, full, empty, tiles, bug);
  }
}
FAGEN_EXPORT(mbarrier_pipeline)
