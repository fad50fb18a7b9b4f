"""The mbarrier, named-barrier and warpgroup twins against the hardware: the mbarrier pipeline the
emulator runs (tests/support/mbarrier_pipeline_case.py; its producer sets setmaxnreg, so sm_90a) must
pass every tile intact on a compute-capability 9.0 GPU. Marked `gpu` and `twins`."""

from __future__ import annotations

import pytest
import torch

import mbarrier_pipeline_case as case
from gpu_twin_launch import gpu_function, require_capability

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("tiles", [1, 2, 7])
def test_the_mbarrier_pipeline_passes_every_tile_on_the_gpu(tiles):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")
    kernel = gpu_function(case.KERNEL.read_text(), "mbarrier_pipeline", "sm_90a")
    y, x = case.run(kernel, 0, tiles=tiles, device="cuda")
    assert torch.equal(y.cpu(), x.cpu())
