// wgmma pipelines with planted bugs (tests/emulate/test_emulate_wgmma_faults.py). One warpgroup;
// `image` is copied into a 1024-byte-aligned tile; p[8 * s .. 8 * s + 7] give operand pair s's
// descriptors (A offset, LBO, SBO, swizzle, B likewise), N = 16. `bug` selects the mistake
// (uniform over the block, so every thread takes the same branches):
//   0 none; 1 no wgmma.fence before the first wgmma; 2 the B tile overwritten before the wait;
//   3 wait_group 1 where 0 is needed; 4 accumulators rescaled by the threads, no fence after;
//   5 one warp skips the wgmma; 6 lanes 1-31 of each warp wait in __syncwarp for lane 0, which
//   waits in wgmma.fence for them (a deadlock); 7 no barrier between the threads' copy into the
//   tile and the wgmmas that read it (a race); 8 thread 5 passes another B descriptor; 9 the A
//   descriptor has base offset 1 (not modelled); 10 no fence.proxy.async between the threads'
//   copy (generic proxy) and the wgmmas (async proxy) that read it.
#include <fagen/prelude.cuh>
#include <fagen/proxy_fence.cuh>
#include <fagen/wgmma.cuh>

constexpr int kN = 16;

__device__ uint64_t descriptor(uint32_t base, const int* p, uint32_t base_offset = 0) {
  return fagen::make_smem_desc(base + p[0], p[1], p[2], p[3], base_offset);
}

// out[0 .. 128 * 8): D1 = A0 B0 + A1 B1 (two chained wgmmas, one group); then
// out[128 * 8 .. 2 * 128 * 8): E = A1 B1 (a second group); then
// out[2 * 128 * 8 ..): 2 * D1 + A0 B0 (a wgmma after the threads rescaled D1).
extern "C" __global__ void wgmma_pipeline(const unsigned char* image, int image_bytes, const int* p, float* out,
                                          int bug) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t window = fagen::shared_window_address(smem);
  unsigned char* tile = smem + (1024 - window % 1024) % 1024;
  const uint32_t base = fagen::shared_window_address(tile);
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) tile[i] = image[i];
  if (bug != 10) fagen::fence_proxy_async_shared();   // the copy, made visible to the async proxy
  if (bug != 7) __syncthreads();
  const int t = threadIdx.x;
  float d[kN / 2], e[kN / 2];
  for (int i = 0; i < kN / 2; ++i) d[i] = e[i] = 0.f;
  if (bug == 6 && t % 32 != 0) __syncwarp();
  if (bug != 1) fagen::wgmma_fence();
  if (bug == 5 && t >= 96) return;
  fagen::wgmma_ss<kN, false>(d, descriptor(base, p), descriptor(base, p + 4), 1);
  const uint64_t b1 = descriptor(base, bug == 8 && t == 5 ? p + 4 : p + 12);
  fagen::wgmma_ss<kN, false>(d, descriptor(base, p + 8, bug == 9 ? 1 : 0), b1, 1);
  fagen::wgmma_commit();
  fagen::wgmma_ss<kN, false>(e, descriptor(base, p + 8), descriptor(base, p + 12), 0);
  fagen::wgmma_commit();
  if (bug == 11) fagen::wgmma_wait<2>();   // not a bug: a wait that retires nothing, then the real one
  if (bug == 2) {
    tile[p[4] + t] = 0x3c;  // B0's bytes, while the wgmmas reading them are in flight
  }
  if (bug == 3) {
    fagen::wgmma_wait<1>();
  } else {
    fagen::wgmma_wait<0>();
  }
  for (int i = 0; i < kN / 2; ++i) out[t * (kN / 2) + i] = d[i];
  for (int i = 0; i < kN / 2; ++i) out[128 * (kN / 2) + t * (kN / 2) + i] = e[i];
  if (bug == 3) fagen::wgmma_wait<0>();
  for (int i = 0; i < kN / 2; ++i) d[i] *= 2.f;
  if (bug != 4) fagen::wgmma_fence();
  fagen::wgmma_ss<kN, false>(d, descriptor(base, p), descriptor(base, p + 4), 1);
  fagen::wgmma_commit();
  fagen::wgmma_wait<0>();
  for (int i = 0; i < kN / 2; ++i) out[2 * 128 * (kN / 2) + t * (kN / 2) + i] = d[i];
}
FAGEN_EXPORT(wgmma_pipeline)
