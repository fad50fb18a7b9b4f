// Kernels with planted bugs: the emulator must detect each one (an
// EmulationError, a sanitizer report in the checked build, or an unwritten
// output) or at least produce a wrong result. tests/emulate/test_emulate_faults.py.
// Where a flag parameter says `correct`, the same kernel without the bug runs
// too, so each test shows that the fault, not something else, is caught.
#include <fagen/prelude.cuh>
#include <fagen/cp_async.cuh>
#include <fagen/ldmatrix.cuh>
#include <fagen/mma.cuh>

// Each thread reads its neighbour's element from shared memory; without the
// barrier the neighbour may not have written it yet.
extern "C" __global__ void neighbour_exchange(const float* x, float* y, int correct) {
  __shared__ float tile[256];
  const int t = threadIdx.x, n = blockDim.x;
  tile[t] = x[blockIdx.x * n + t];
  if (correct) __syncthreads();
  y[blockIdx.x * n + t] = tile[(t + 1) % n];
}
FAGEN_EXPORT(neighbour_exchange)

// cp.async without wait_group: the barrier alone does not make the data land.
extern "C" __global__ void copy_without_wait(const float* x, float* y, int correct) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* tile = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x, n = blockDim.x;
  fagen::cp_async_16(tile + 4 * t, x + 4 * t, 16);
  fagen::cp_async_commit();
  if (correct) fagen::cp_async_wait<0>();
  __syncthreads();
  for (int i = 0; i < 4; ++i) y[4 * t + i] = tile[4 * ((t + 1) % n) + i];
}
FAGEN_EXPORT(copy_without_wait)

// Only half of each warp takes part in a full-warp shuffle.
extern "C" __global__ void half_warp_shuffle(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
FAGEN_EXPORT(half_warp_shuffle)

// Only half of the warp calls mma.sync.
extern "C" __global__ void half_warp_mma(float* out) {
  uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (threadIdx.x % 32 >= 16) fagen::mma_m16n8k16_f16(acc, a, b);
  out[threadIdx.x] = acc[0];
}
FAGEN_EXPORT(half_warp_mma)

// A shuffle whose source lane is outside the mask.
extern "C" __global__ void shuffle_outside_mask(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_sync(0x0000ffffu, v, 20);
  out[threadIdx.x] = v;
}
FAGEN_EXPORT(shuffle_outside_mask)

// A barrier inside a branch that only the first `reaching` threads take; the
// others run on and exit.
extern "C" __global__ void barrier_in_branch(int* out, int reaching) {
  if (static_cast<int>(threadIdx.x) < reaching) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}
FAGEN_EXPORT(barrier_in_branch)

// Two different barriers for two halves of the block.
extern "C" __global__ void divergent_barriers(int* out) {
  if (threadIdx.x < 64) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}
FAGEN_EXPORT(divergent_barriers)

// Lanes 0-15 of each warp wait at a barrier while lanes 16-31 call a
// full-warp shuffle that needs them: neither can ever complete.
extern "C" __global__ void shuffle_against_barrier(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x % 32 < 16) {
    __syncthreads();
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = v;
}
FAGEN_EXPORT(shuffle_against_barrier)

// Reads one element past the end of x (the last thread of the last block).
extern "C" __global__ void read_past_end(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i + 1];
}
FAGEN_EXPORT(read_past_end)

// Writes one element past the end of y.
extern "C" __global__ void write_past_end(float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) y[i] = 1.f;
}
FAGEN_EXPORT(write_past_end)

// cp.async of a full 16-byte chunk where only `valid` bytes exist.
extern "C" __global__ void cp_async_past_end(const unsigned char* src, unsigned char* dst, int valid, int clamp) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int i = threadIdx.x;
  int bytes = 16;
  if (clamp) {
    const int remaining = valid - 16 * i;
    bytes = remaining < 0 ? 0 : (remaining > 16 ? 16 : remaining);
  }
  fagen::cp_async_16(smem + 16 * i, bytes > 0 ? src + 16 * i : src, bytes);
  fagen::cp_async_wait_all();
  for (int b = 0; b < 16; ++b) dst[16 * i + b] = smem[16 * i + b];
}
FAGEN_EXPORT(cp_async_past_end)

// Uses more dynamic shared memory than the launch provides.
extern "C" __global__ void shared_past_launch_size(float* y, int elements) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* tile = reinterpret_cast<float*>(smem);
  for (int i = threadIdx.x; i < elements; i += blockDim.x) tile[i] = 1.f;
  __syncthreads();
  y[threadIdx.x] = tile[threadIdx.x];
}
FAGEN_EXPORT(shared_past_launch_size)

// ldmatrix rows past the launch's dynamic shared memory.
extern "C" __global__ void ldmatrix_past_launch_size(unsigned* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint32_t r[4];
  fagen::ldmatrix_x4(r, smem + 16 * threadIdx.x);
  out[threadIdx.x] = r[0];
}
FAGEN_EXPORT(ldmatrix_past_launch_size)

// ldmatrix with a row address that is not 16-byte aligned.
extern "C" __global__ void ldmatrix_misaligned(unsigned* out) {
  __shared__ __align__(16) unsigned short table[64 * 8 + 8];
  for (int i = threadIdx.x; i < 64 * 8 + 8; i += 32) table[i] = static_cast<unsigned short>(i);
  __syncwarp();
  uint32_t r[1];
  fagen::ldmatrix_x1(r, &table[threadIdx.x * 8 + (threadIdx.x == 3 ? 4 : 0)]);
  out[threadIdx.x] = r[0];
}
FAGEN_EXPORT(ldmatrix_misaligned)

// A per-thread array indexed out of range.
extern "C" __global__ void local_array_overflow(int* out, int index) {
  int local[8];
  for (int i = 0; i < 8; ++i) local[i] = i * static_cast<int>(threadIdx.x);
  out[threadIdx.x] = local[index];
}
FAGEN_EXPORT(local_array_overflow)

// 32-bit index arithmetic that overflows.
extern "C" __global__ void index_overflow(int* out, int row, int stride) {
  out[threadIdx.x] = row * stride + static_cast<int>(threadIdx.x);
}
FAGEN_EXPORT(index_overflow)

// Leaves the last element of y unwritten.
extern "C" __global__ void skips_last_element(float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n - 1) y[i] = 2.f;
}
FAGEN_EXPORT(skips_last_element)

// A device-side assert.
extern "C" __global__ void asserts_positive(const int* x) {
  assert(x[threadIdx.x] > 0);
}
FAGEN_EXPORT(asserts_positive)

// Thread 0 spins on a flag that the others set only after a barrier thread 0
// never reaches.
extern "C" __global__ void spin_on_flag(int* out) {
  __shared__ volatile int flag[1];
  if (threadIdx.x == 0) flag[0] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    while (flag[0] == 0) __nanosleep(100);
  } else {
    __syncthreads();
    flag[0] = 1;
  }
  out[threadIdx.x] = 1;
}
FAGEN_EXPORT(spin_on_flag)
