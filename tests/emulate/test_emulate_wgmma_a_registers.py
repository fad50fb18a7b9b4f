"""wgmma's A from registers in the emulator: poisoned from issue to the wait that retires the last
wgmma reading them, checked and restored there (fagen/emulate/src/wgmma.cpp). Two wgmmas in flight
on one A array read its values and leave them intact after the wait; a thread that writes A while
they are in flight is named at the wait."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from fagen.emulate import EmulationError, load_module

# One warpgroup; B (8 keys x 16) in shared memory, K-major, no swizzle: B[n][k] = 1 where k == n,
# so D = A's first 8 columns. A[m][k] = (m + 3 k) % 7 - 3, exact in fp16.
SOURCE = r"""
#include <fagen/prelude.cuh>
#include <fagen/proxy_fence.cuh>
#include <fagen/wgmma.cuh>

__device__ uint32_t element(int m, int k) {
  return __half_as_ushort(__float2half((float)((m + 3 * k) % 7 - 3)));
}

// A's register r of thread t (w, g, q): A[16w + g + 8 (r % 2)][8 (r / 2) + 2q + {0, 1}].
__device__ uint32_t a_register(int w, int g, int q, int r) {
  const int m = 16 * w + g + 8 * (r % 2), k = 8 * (r / 2) + 2 * q;
  return element(m, k) | element(m, k + 1) << 16;
}

extern "C" __global__ void a_registers(float* out, int bug) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t window = fagen::shared_window_address(smem);
  unsigned char* tile = smem + (1024 - window % 1024) % 1024;
  const int t = threadIdx.x, w = t / 32, g = t % 32 / 4, q = t % 4;
  // B element (n, k) at (n % 8) * 16 + (k / 8) * 128 + (k % 8) * 2 (LBO 128).
  for (int i = t; i < 8 * 16; i += 128) {
    const int n = i / 16, k = i % 16;
    const int at = ((n % 8) * 16 + (k / 8) * 128 + (k % 8) * 2) / 2;
    reinterpret_cast<__half*>(tile)[at] = __float2half(k == n ? 1.f : 0.f);
  }
  fagen::fence_proxy_async_shared();
  __syncthreads();
  uint32_t a[4];
  for (int r = 0; r < 4; ++r) a[r] = a_register(w, g, q, r);
  float d1[4] = {0.f, 0.f, 0.f, 0.f}, d2[4] = {0.f, 0.f, 0.f, 0.f};
  const uint64_t b = fagen::make_smem_desc(fagen::shared_window_address(tile), 128, 256, fagen::kSwizzleNone);
  fagen::wgmma_fence();
  fagen::wgmma_rs<8, false>(d1, a, b, 0);
  fagen::wgmma_rs<8, false>(d2, a, b, 0);   // the same A registers, the first still in flight
  fagen::wgmma_commit();
  if (bug == 1) a[2] ^= 1u;                  // a write to A while both are in flight
  fagen::wgmma_wait<0>();
  for (int i = 0; i < 4; ++i) out[t * 12 + i] = d1[i], out[t * 12 + 4 + i] = d2[i];
  for (int r = 0; r < 4; ++r) out[t * 12 + 8 + r] = static_cast<float>(a[r] == a_register(w, g, q, r));
}
FAGEN_EXPORT(a_registers)
"""


@functools.lru_cache(maxsize=1)
def kernel():
    return load_module(SOURCE).get_function("a_registers")


def run(bug: int) -> np.ndarray:
    out = torch.full((128 * 12,), float("nan"))
    kernel()((1, 1, 1), (128, 1, 1), (out, np.int32(bug)), shared_mem=2048)
    return out.view(128, 12).numpy()


def test_two_wgmmas_on_one_a_array_read_it_and_leave_it_intact():
    out = run(0)
    for t in range(128):
        w, g, q = t // 32, t % 32 // 4, t % 4
        for i in range(4):   # d[i]: D[16w + g + 8 ((i / 2) % 2)][2q + i % 2] = A[m][n]
            m, n = 16 * w + g + 8 * ((i // 2) % 2), 2 * q + i % 2
            want = (m + 3 * n) % 7 - 3
            assert out[t, i] == want and out[t, 4 + i] == want, (t, i)
    assert (out[:, 8:] == 1).all(), "the A registers came back from the wait changed"


def test_a_write_to_a_while_in_flight_is_named_at_the_wait():
    with pytest.raises(EmulationError, match=r"A register 2 changed between its issue and the wgmma.wait_group"):
        run(1)
