// TMA feeding wgmma, the Hopper GEMM's core in miniature: C (64 x 64, fp32) = A B^T with A and B
// bf16 64 x 64 row-major (B's rows are C's columns, so both operands are K-major), loaded by TMA
// with the 128B swizzle (a row of 64 bf16 is one 128-byte swizzle row) into 1024-byte-aligned
// tiles, and multiplied by one warpgroup with four wgmma.m64n64k16 whose descriptors name the
// same swizzle: 8 rows of 128 bytes per core-matrix group (SBO 1024), each k-step 32 bytes along
// the row (the swizzle acts on the absolute address, so stepping the start address is enough).
//
// `bug` plants one fault (tests/support/tma_wgmma_case.py): 0 none; 1 the descriptors say 64B while
// the maps say 128B; 2 the descriptors take CUtensorMapSwizzle's number for 128B (3, which a
// descriptor reads as 32B); 3 the warpgroup does not wait for the tiles' mbarrier; 4 the k-step
// is 16 bytes (one 8-element half of k16); 5 LBO and SBO swapped.
#include <fagen/prelude.cuh>
#include <fagen/mbarrier.cuh>
#include <fagen/smem_desc.cuh>
#include <fagen/tma.cuh>
#include <fagen/wgmma.cuh>

extern "C" __global__ void tma_wgmma(const __grid_constant__ fagen::TensorMap a_map,
                                     const __grid_constant__ fagen::TensorMap b_map, float* c, int bug) {
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) uint64_t full;
  const uint32_t window = fagen::shared_window_address(smem);
  unsigned char* a_tile = smem + (1024 - window % 1024) % 1024;   // the 128B swizzle repeats every 1024 bytes
  unsigned char* b_tile = a_tile + 8192;
  const int t = threadIdx.x;
  if (t == 0) {
    fagen::mbarrier_init(&full, 1);
    fagen::mbarrier_init_fence();
  }
  __syncthreads();
  if (t == 0) {
    fagen::mbarrier_arrive_expect_tx(&full, 2 * 8192);
    const int origin[2] = {0, 0};
    fagen::tma_load<2>(a_tile, a_map, origin, &full);
    fagen::tma_load<2>(b_tile, b_map, origin, &full);
  }
  if (bug != 3) fagen::mbarrier_wait_parity(&full, 0);
  const uint32_t swizzle = bug == 1 ? fagen::kSwizzle64B : bug == 2 ? 3u : fagen::kSwizzle128B;
  const uint32_t step = bug == 4 ? 16 : 32;
  const uint32_t a0 = fagen::shared_window_address(a_tile), b0 = fagen::shared_window_address(b_tile);
  float acc[32];
  fagen::wgmma_fence();
  for (int k = 0; k < 4; ++k) {
    const uint32_t lbo = bug == 5 ? 1024 : 16, sbo = bug == 5 ? 16 : 1024;
    const uint64_t a = fagen::make_smem_desc(a0 + step * k, lbo, sbo, swizzle);
    const uint64_t b = fagen::make_smem_desc(b0 + step * k, lbo, sbo, swizzle);
    fagen::wgmma_ss<64, true>(acc, a, b, k > 0 ? 1 : 0);
  }
  fagen::wgmma_commit();
  fagen::wgmma_fence_operands<64>(acc);
  fagen::wgmma_wait<0>();
  fagen::wgmma_fence_operands<64>(acc);
  // The accumulator fragment: warp w holds rows 16w..16w+15, register 4j + e the m16n8 C layout's
  // element e of columns 8j..8j+7.
  const int warp = t / 32, g = t % 32 / 4, q = t % 4;
  for (int i = 0; i < 32; ++i) {
    const int j = i / 4, e = i % 4;
    c[(16 * warp + g + 8 * (e / 2)) * 64 + 8 * j + 2 * q + e % 2] = acc[i];
  }
}
FAGEN_EXPORT(tma_wgmma)
