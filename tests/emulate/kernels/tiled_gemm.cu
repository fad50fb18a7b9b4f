// C = A B^T with the building blocks of the attention kernels: a two-stage
// cp.async pipeline into padded shared tiles, ldmatrix, and mma.sync.
// A is M x K and B is N x K (both row-major fp16), C is M x N fp32. K must be
// a multiple of 32; ragged M and N tails are zero-filled by cp.async.
// One block (4 warps) per 64 x 64 tile of C; warp w owns rows 16w..16w+15.
#include <fagen/prelude.cuh>
#include <fagen/cp_async.cuh>
#include <fagen/ldmatrix.cuh>
#include <fagen/mma.cuh>

namespace {

constexpr int kTile = 64;      // rows of A and of B per block
constexpr int kStep = 32;      // K per pipeline stage
constexpr int kRow = kStep + 8;  // padded shared row, in halves
constexpr int kThreads = 128;

__device__ __forceinline__ void load_stage(__half* a_tile, __half* b_tile, const __half* A, const __half* B,
                                           int m0, int n0, int k0, int M, int N, int K) {
  constexpr int kChunksPerRow = kStep / 8;
  for (int chunk = threadIdx.x; chunk < kTile * kChunksPerRow; chunk += kThreads) {
    const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
    const bool a_inside = m0 + r < M, b_inside = n0 + r < N;
    fagen::cp_async_16(a_tile + r * kRow + c, a_inside ? A + (long long)(m0 + r) * K + k0 + c : A,
                       a_inside ? 16 : 0);
    fagen::cp_async_16(b_tile + r * kRow + c, b_inside ? B + (long long)(n0 + r) * K + k0 + c : B,
                       b_inside ? 16 : 0);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128)
gemm_abt(const __half* __restrict__ A, const __half* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
  extern __shared__ __align__(16) unsigned char smem[];
  __half* a_tiles = reinterpret_cast<__half*>(smem);       // [2][kTile][kRow]
  __half* b_tiles = a_tiles + 2 * kTile * kRow;            // [2][kTile][kRow]
  const int m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;

  float acc[8][4];
  for (int nt = 0; nt < 8; ++nt)
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;

  const int steps = K / kStep;
  load_stage(a_tiles, b_tiles, A, B, m0, n0, 0, M, N, K);
  fagen::cp_async_commit();
  for (int s = 0; s < steps; ++s) {
    const int stage = s % 2;
    if (s + 1 < steps) {
      const int next = (s + 1) % 2;
      load_stage(a_tiles + next * kTile * kRow, b_tiles + next * kTile * kRow, A, B, m0, n0, (s + 1) * kStep,
                 M, N, K);
    }
    fagen::cp_async_commit();  // possibly empty: keeps the group count regular
    fagen::cp_async_wait<1>();
    __syncthreads();
    const __half* a_tile = a_tiles + stage * kTile * kRow;
    const __half* b_tile = b_tiles + stage * kTile * kRow;
    for (int ks = 0; ks < kStep / 16; ++ks) {
      uint32_t a[4];
      fagen::ldmatrix_x4(a, a_tile + (warp * 16 + lane % 16) * kRow + ks * 16 + (lane / 16) * 8);
      for (int np = 0; np < 4; ++np) {
        const int m = lane / 8;  // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
        uint32_t b[4];
        fagen::ldmatrix_x4(b, b_tile + (np * 16 + (m / 2) * 8 + lane % 8) * kRow + ks * 16 + (m % 2) * 8);
        fagen::mma_m16n8k16_f16(acc[2 * np], a, b);
        fagen::mma_m16n8k16_f16(acc[2 * np + 1], a, b + 2);
      }
    }
    __syncthreads();  // everyone is done with this stage before it is refilled
  }

  for (int nt = 0; nt < 8; ++nt) {
    for (int e = 0; e < 4; ++e) {
      const int row = m0 + warp * 16 + g + 8 * (e / 2), col = n0 + nt * 8 + 2 * t + e % 2;
      if (row < M && col < N) C[(long long)row * N + col] = acc[nt][e];
    }
  }
}
FAGEN_EXPORT(gemm_abt)
