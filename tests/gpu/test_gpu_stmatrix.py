"""The stmatrix twin against the hardware: the emulator test's kernel and expectations (the PTX
ISA's figure; tests/support/stmatrix_case.py), on a GPU of compute capability 9.0 or newer.
Marked `gpu` and `twins`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_twin_launch import gpu_function, require_capability
from stmatrix_case import CASES, SOURCE, expected_tile, run

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("count, transpose", CASES, ids=[f"x{c}{'.trans' if t else ''}" for c, t in CASES])
def test_stmatrix_on_the_gpu(count, transpose):
    kernel = gpu_function(SOURCE, "stmatrix_layout", require_capability(9, 0))
    regs, perm, tile, back = run(kernel, "cuda", count, transpose)
    np.testing.assert_array_equal(tile, expected_tile(regs, perm, count, transpose))
    if count == 4:
        np.testing.assert_array_equal(back.reshape(32, 4), regs)
