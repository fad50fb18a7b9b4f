"""The stmatrix layout case (fagen/stmatrix.cuh), shared by the emulator's test
(tests/emulate/test_emulate_stmatrix.py) and the hardware's (tests/gpu/test_gpu_stmatrix.py): one
kernel, one expectation read from the PTX ISA's figure (tests/support/isa_fragments.py)."""

from __future__ import annotations

import numpy as np
import torch

import isa_fragments as isa

SOURCE = r"""
#include <fagen/prelude.cuh>
#include <fagen/ldmatrix.cuh>
#include <fagen/stmatrix.cuh>

// One warp: lane l stores its registers regs[l][0..count) with stmatrix, giving the address of row
// slot perm[l] of a 32 x 8 b16 shared tile (slots no lane writes keep 0xBEEF); out gets the tile,
// and back[l][k] what ldmatrix (same count and layout) reads again from the same addresses.
extern "C" __global__ void stmatrix_layout(const unsigned* regs, const int* perm, unsigned short* out,
                                           unsigned* back, int count, int transpose) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto* tile = reinterpret_cast<unsigned short*>(smem);
  const int lane = threadIdx.x;
  for (int i = lane; i < 32 * 8; i += 32) tile[i] = 0xBEEF;
  __syncwarp();
  uint32_t r[4], again[4] = {0, 0, 0, 0};
  for (int k = 0; k < 4; ++k) r[k] = regs[lane * 4 + k];
  unsigned short* row = tile + perm[lane] * 8;
  if (count == 1) {
    fagen::stmatrix_x1(row, r);
  } else if (count == 2) {
    fagen::stmatrix_x2(row, r);
  } else if (transpose) {
    fagen::stmatrix_x4_trans(row, r);
  } else {
    fagen::stmatrix_x4(row, r);
  }
  __syncwarp();
  for (int i = lane; i < 32 * 8; i += 32) out[i] = tile[i];
  if (count == 4) {
    if (transpose) {
      fagen::ldmatrix_x4_trans_at(again, fagen::smem_address(row));
    } else {
      fagen::ldmatrix_x4_at(again, fagen::smem_address(row));
    }
  }
  for (int k = 0; k < 4; ++k) back[lane * 4 + k] = again[k];
}
FAGEN_EXPORT(stmatrix_layout)
"""
CASES = [(1, False), (2, False), (4, False), (4, True)]


def expected_tile(regs: np.ndarray, perm: np.ndarray, count: int, transpose: bool) -> np.ndarray:
    """From the ISA's figure: the element a grid cell names (lane, half) of matrix k goes to (row, col)
    of matrix k, whose row j sits at the address lane 8k + j gives."""
    grid = isa.parse(isa.STMATRIX_TRANS if transpose else isa.STMATRIX)
    tile = np.full((32, 8), 0xBEEF, dtype=np.uint16)
    for k, lanes in isa.LDMATRIX_ADDRESS_LANES[count].items():
        lanes = list(lanes)
        for (lane, half), (r, c) in grid.items():
            tile[perm[lanes[r]], c] = (int(regs[lane, k]) >> (16 * half)) & 0xFFFF
    return tile


def run(kernel, device: str, count: int, transpose: bool):
    rng = np.random.default_rng(10 * count + transpose)
    regs = rng.integers(0, 2**32, size=(32, 4), dtype=np.uint64).astype(np.uint32)
    perm = rng.permutation(32).astype(np.int32)   # lanes point at shuffled row slots
    out = torch.zeros(32 * 8, dtype=torch.int16, device=device)
    back = torch.zeros(32 * 4, dtype=torch.int32, device=device)
    args = (torch.from_numpy(regs.view(np.int32)).to(device), torch.from_numpy(perm).to(device), out, back,
            np.int32(count), np.int32(int(transpose)))
    kernel((1, 1, 1), (32, 1, 1), args, shared_mem=32 * 8 * 2)
    return regs, perm, out.cpu().numpy().view(np.uint16).reshape(32, 8), back.cpu().numpy().view(np.uint32)
