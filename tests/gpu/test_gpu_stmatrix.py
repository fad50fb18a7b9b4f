"""The stmatrix twin against the hardware: the emulator test's kernel and expectations (the PTX
ISA's figure; tests/support/stmatrix_case.py), on a GPU of compute capability 9.0 or newer.
Marked `gpu` and `twins`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stmatrix_case import CASES, SOURCE, expected_tile, run

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("count, transpose", CASES, ids=[f"x{c}{'.trans' if t else ''}" for c, t in CASES])
def test_stmatrix_on_the_gpu(count, transpose):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("stmatrix needs sm_90")
    from fagen.kernels.compile import nvrtc_compile
    import cupy

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    cubin, _ = nvrtc_compile(SOURCE, arch)
    module = cupy.cuda.function.Module()
    module.load(cubin)
    function = module.get_function("stmatrix_layout")

    def kernel(grid, block, args, shared_mem=0):
        converted = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args)
        function(grid, block, converted, shared_mem=shared_mem)
        torch.cuda.synchronize()

    regs, perm, tile, back = run(kernel, "cuda", count, transpose)
    np.testing.assert_array_equal(tile, expected_tile(regs, perm, count, transpose))
    if count == 4:
        np.testing.assert_array_equal(back.reshape(32, 4), regs)
