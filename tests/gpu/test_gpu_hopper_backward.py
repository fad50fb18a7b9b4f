"""The prototype Hopper backward against the hardware: the emulator's micro-kernel
(tests/support/hopper_backward_case.py) with the driver's tensor maps on a compute-capability 9.0
GPU must meet the same gradient rule against the same float64 oracle (and store no key past Nk).
Marked `gpu` and `twins`."""

from __future__ import annotations

import pytest
import torch

import hopper_backward_case as case
from gpu_twin_launch import gpu_function, require_capability

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# The emulator's shapes, and one with many query blocks and key blocks, both ragged.
SHAPES = [(1, 100, 200, 2), (1, 300, 130, 1), (2, 1000, 2049, 3)]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_q{}_k{}_h{}".format(*s))
def test_hopper_backward_on_the_gpu(shape, dtype, causal):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")
    kernel = gpu_function(case.KERNEL.read_text(), f"hopper_backward_{dtype}", "sm_90a")
    inputs, grads = case.run(kernel, *shape, dtype, causal, encode="driver_bytes", device="cuda")
    case.check(*inputs, *grads, causal)
