"""TMA into wgmma against the hardware: the emulator's micro-kernel (tests/support/tma_wgmma_case.py)
with the driver's tensor maps on a compute-capability 9.0 GPU must give the exact product. Marked
`gpu` and `twins`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tma_wgmma_case as case
from gpu_twin_launch import gpu_function, require_capability

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tma_into_wgmma_on_the_gpu():
    if require_capability(9, 0) != "sm_90":
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")
    kernel = gpu_function(case.KERNEL.read_text(), "tma_wgmma", "sm_90a")
    a, b, c = case.inputs(device="cuda")
    kernel((1,), (128,), (*case.maps(a, b, "driver_bytes"), c, np.int32(0)), shared_mem=case.SHARED)
    assert torch.equal(c.cpu().double(), case.expected(a, b))
