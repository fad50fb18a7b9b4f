"""tanh.approx.f32's error (fagen/numeric.cuh tanh_approx, the softcap's tanh), shared by the
emulator's test of its twin (tests/emulate/test_emulate_numeric.py) and the hardware's
measurement (tests/gpu/test_gpu_tanh.py): one kernel, one sweep of inputs, one error against
float64 tanh.

The sweep: every float in [-10, 10] at a step of 2^-17 (each exact in fp32), and every 511th fp32
bit pattern from the smallest normal float to 10, both signs (about 2^14 points a binade, so the
inputs near 0, where a relative error is easiest to lose, are as dense as the rest; an odd stride,
so that odd and even last bits both come, which the grid's never are: the twin errs up on one,
down on the other). Past 10
tanh is 1 in fp32 to within 2^-28. Subnormal inputs are swept apart: the ISA bounds them too
("subnormal numbers are supported"), but the twin's own product rounds to the subnormal grid
there and errs past it (up to half a unit of that grid more: 9.8e-4 measured on the emulator,
for the bound's 4.93e-4), so they are measured, not held to the bound.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SOURCE = r"""
#include <fagen/prelude.cuh>
#include <fagen/numeric.cuh>
extern "C" __global__ void tanh_approx_of(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fagen::tanh_approx(x[i]);
}
FAGEN_EXPORT(tanh_approx_of)
"""
KERNEL = "tanh_approx_of"
BLOCK = 128

GRID_STEP_LOG2 = 17            # the grid's step, 2^-17
LIMIT = 10                     # the grid spans [-LIMIT, LIMIT]
BIT_STRIDE = 511               # every 511th bit pattern (odd: both parities of the last bit)
SMALLEST_NORMAL_BITS, LIMIT_BITS = 0x00800000, 0x41200000   # FLT_MIN and 10.0f
# Inputs whose result the ISA names (ISA "corner cases"), and far ones that must come out near +-1.
SIGNED_ZEROS = (0.0, -0.0)
SATURATING = (math.inf, -math.inf, 3.4028234663852886e38, -3.4028234663852886e38, 1e4, -1e4, 88.0, -88.0)


def _magnitudes(first_bits: int, last_bits: int) -> torch.Tensor:
    bits = np.arange(first_bits, last_bits + 1, BIT_STRIDE, dtype=np.int64).astype(np.int32)
    return torch.from_numpy(bits.view(np.float32).copy())


def normal_sweep() -> torch.Tensor:
    """The sweep's normal inputs (see the module doc), fp32 on the CPU."""
    steps = LIMIT << GRID_STEP_LOG2
    grid = (torch.arange(-steps, steps + 1, dtype=torch.float64) * 2.0 ** -GRID_STEP_LOG2).float()
    magnitudes = _magnitudes(SMALLEST_NORMAL_BITS, LIMIT_BITS)
    return torch.cat([grid[grid != 0], magnitudes, -magnitudes])


def subnormal_sweep() -> torch.Tensor:
    magnitudes = _magnitudes(1, SMALLEST_NORMAL_BITS - 1)
    return torch.cat([magnitudes, -magnitudes])


def errors(x: torch.Tensor, y: torch.Tensor) -> dict:
    """Against float64 tanh: the largest relative and absolute errors and where (x), and how
    many inputs; a NaN result counts as an infinite error."""
    x64, exact = x.double(), torch.tanh(x.double())
    absolute = (y.double() - exact).abs().nan_to_num(nan=math.inf)
    relative = absolute / exact.abs()
    worst_rel, worst_abs = int(relative.argmax()), int(absolute.argmax())
    return {"max_rel": float(relative[worst_rel]), "max_rel_at": float(x64[worst_rel]),
            "max_abs": float(absolute[worst_abs]), "max_abs_at": float(x64[worst_abs]), "inputs": x.numel()}


def launch(kernel, x: torch.Tensor) -> torch.Tensor:
    """tanh_approx of every element of `x` (on the kernel's device) by `kernel`, called as the
    emulator's functions and tests/support/gpu_twin_launch's are: (grid, block, args)."""
    y = torch.empty_like(x)
    kernel(((x.numel() + BLOCK - 1) // BLOCK,), (BLOCK,), (x, y, np.int32(x.numel())))
    return y
