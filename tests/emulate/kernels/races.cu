// Planted races and memory-access patterns for racecheck and the counters
// (tests/emulate/test_emulate_racecheck.py; the cp.async one is planted_bugs.cu's
// copy_without_wait). Each kernel takes `correct`: with 1 it is the right
// kernel, with 0 it has the planted bug, so a test shows that the bug, not
// something else, is reported.
#include <fagen/prelude.cuh>
#include <fagen/cp_async.cuh>
#include <fagen/ldmatrix.cuh>
#include <fagen/named_barrier.cuh>

// A two-stage pipeline in miniature: every warp reads a shared tile, then
// warp 0 refills it for the next step. Without the barrier between the reads
// and the refill, slower warps read the next step's data (write-after-read).
extern "C" __global__ void refill_without_barrier(const float* x, float* y, int steps, int correct) {
  __shared__ float tile[128];
  const int t = threadIdx.x;
  if (t < 128) tile[t] = x[t];
  __syncthreads();
  float sum = 0.f;
  for (int step = 0; step < steps; ++step) {
    sum += tile[(t * 7 + step) % 128];
    if (correct) __syncthreads();
    if (t < 32)
      for (int i = t; i < 128; i += 32) tile[i] = x[(step + 1) * 128 + i];
    __syncthreads();
  }
  y[blockIdx.x * blockDim.x + t] = sum;
}
FAGEN_EXPORT(refill_without_barrier)

// Lanes exchange values through shared memory: lane i writes slot i, then reads
// slot i ^ 1. Within a warp only __syncwarp orders that (correct = 1); a
// shuffle (correct = 2) is a warp rendezvous but orders no memory on Volta and
// later: strict racecheck reports it, the lenient switch accepts it.
extern "C" __global__ void lane_exchange(const float* x, float* y, int correct) {
  __shared__ float slots[64];
  const int t = threadIdx.x;
  slots[t] = x[t];
  if (correct == 1) __syncwarp();
  if (correct == 2) (void)__shfl_sync(0xffffffffu, t, 0);
  y[t] = slots[t ^ 1];
}
FAGEN_EXPORT(lane_exchange)

// Every block stores the same elements: a race between blocks unless atomic.
extern "C" __global__ void blocks_share_outputs(float* y, int correct) {
  if (correct) {
    atomicAdd(y + threadIdx.x, 1.f);
  } else {
    y[threadIdx.x] = static_cast<float>(blockIdx.x);
  }
}
FAGEN_EXPORT(blocks_share_outputs)

// -- counters --------------------------------------------------------------------------------

// ldmatrix.x4 from a 16 x 64 half tile with rows of `row_elems` halves: 72
// (padded by 8, as fagen's tiles are) spreads the 8 rows of each matrix over all
// 32 banks; 64 (unpadded) puts them all in the same 4 banks.
extern "C" __global__ void ldmatrix_rows(const __half* x, float* y, int row_elems) {
  extern __shared__ __align__(16) unsigned char smem[];
  __half* tile = reinterpret_cast<__half*>(smem);
  const int lane = threadIdx.x;
  for (int i = lane; i < 16 * 64; i += 32) tile[(i / 64) * row_elems + i % 64] = x[i];
  __syncwarp();
  unsigned regs[4];
  fagen::ldmatrix_x4(regs, tile + (lane % 16) * row_elems + (lane / 16) * 8);
  y[lane] = static_cast<float>(regs[0] & 0xffffu);
}
FAGEN_EXPORT(ldmatrix_rows)

// Each lane loads one float: `stride` 1 is coalesced (4 sectors of 32 bytes per
// warp-level load), a stride of 32 floats touches a sector per lane.
extern "C" __global__ void strided_load(const float* x, float* y, int stride) {
  const int lane = threadIdx.x;
  y[lane] = x[lane * stride];
}
FAGEN_EXPORT(strided_load)

// 64 threads: warp 0 writes a tile and arrives at named barrier 1 (bar.arrive); warp 1 reads
// it after bar.sync (correct) or after bar.arrive, which acquires nothing (a race).
extern "C" __global__ void named_handoff(const float* x, float* y, int correct) {
  __shared__ float tile[32];
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < 32) {
    tile[lane] = x[lane];
    fagen::named_barrier_arrive(1, 64);
    __syncwarp();  // the lanes arrive before any exits (the twin counts a warp by its live lanes)
  } else {
    if (correct) {
      fagen::named_barrier_sync(1, 64);
    } else {
      fagen::named_barrier_arrive(1, 64);
    }
    y[lane] = tile[31 - lane];
  }
}
FAGEN_EXPORT(named_handoff)
