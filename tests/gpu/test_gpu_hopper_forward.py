"""The prototype Hopper forward against the hardware: the emulator's micro-kernel
(tests/support/hopper_forward_case.py) with the driver's tensor maps on a compute-capability 9.0
GPU must meet the same rule against the same float64 oracle (and store no row past Nq). Marked
`gpu` and `twins`."""

from __future__ import annotations

import pytest
import torch

import hopper_forward_case as case
from gpu_twin_launch import gpu_function, require_capability

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# The emulator's shapes, and one with several query blocks and key tiles, both ragged.
SHAPES = [(1, 128, 128, 1), (2, 200, 300, 2), (1, 1000, 2049, 3)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_q{}_k{}_h{}".format(*s))
def test_hopper_forward_on_the_gpu(shape, dtype):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")
    kernel = gpu_function(case.KERNEL.read_text(), f"hopper_forward_{dtype}", "sm_90a")
    q, k, v = (t.cuda() for t in case.inputs(*shape, dtype))
    out, lse = case.launch(kernel, q, k, v, "driver_bytes")
    case.check(q, k, v, out, lse)
