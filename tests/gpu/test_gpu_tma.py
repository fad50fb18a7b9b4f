"""The TMA twin against the hardware: the pipeline micro-kernel the emulator runs
(tests/emulate/test_emulate_tma.py; tests/support/tma_pipeline_case.py), compiled for sm_90a with the
driver's own tensor maps, must give the same results on a compute-capability 9.0 GPU. A mismatch here,
with the emulator's test passing, means the twin misreads the ISA. Marked `gpu` and `twins`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tma_pipeline_case as case
from fagen.kernels.tensor_map import Swizzle, TensorMapSpec
from gpu_twin_launch import gpu_function, require_capability

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("tiles", [1, 5])
def test_the_tma_pipeline_matches_on_the_gpu(tiles):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")
    kernel = gpu_function(case.KERNEL.read_text(), "tma_pipeline", "sm_90a")
    x, y, sums = case.inputs(tiles, device="cuda")
    maps = [TensorMapSpec.of_tensor(t, (case.ROWS, case.COLS), swizzle=Swizzle.B128).driver_bytes(t)
            for t in (x, y)]
    kernel((case.BLOCKS,), (case.THREADS,), (*maps, sums, np.int32(tiles), np.int32(0)), shared_mem=case.SHARED)
    expected_y, expected_sums = case.expected(x, tiles)
    assert torch.equal(y.cpu(), expected_y)
    assert torch.equal(sums.cpu(), expected_sums)
