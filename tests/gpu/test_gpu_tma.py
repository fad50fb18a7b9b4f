"""The TMA twin against the hardware: the pipeline micro-kernel the emulator runs
(tests/emulate/test_emulate_tma.py; tests/support/tma_pipeline_case.py), compiled for sm_90a with the
driver's own tensor maps, must give the same results on a compute-capability 9.0 GPU. A mismatch here,
with the emulator's test passing, means the twin misreads the ISA. Marked `gpu`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tma_pipeline_case as case
from fagen.kernels.tensor_map import Swizzle, TensorMapSpec

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MAP = np.dtype([("opaque", np.uint64, (16,))])   # a CUtensorMap's 128 bytes, passed by value


def _hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")


@pytest.mark.parametrize("tiles", [1, 5])
def test_the_tma_pipeline_matches_on_the_gpu(tiles):
    _hopper()
    import cupy

    from fagen.kernels.compile import nvrtc_compile

    cubin, _ = nvrtc_compile(case.KERNEL.read_text(), "sm_90a")
    module = cupy.cuda.function.Module()
    module.load(cubin)
    kernel = module.get_function("tma_pipeline")
    x, y, sums = case.inputs(tiles, device="cuda")
    maps = [np.frombuffer(TensorMapSpec.of_tensor(t, (case.ROWS, case.COLS), swizzle=Swizzle.B128)
                          .driver_bytes(t.data_ptr()), dtype=MAP)[0] for t in (x, y)]
    torch.cuda.synchronize()
    kernel((case.BLOCKS, 1, 1), (case.THREADS, 1, 1), (*maps, np.uint64(sums.data_ptr()), np.int32(tiles), np.int32(0)),
           shared_mem=case.SHARED)
    torch.cuda.synchronize()
    expected_y, expected_sums = case.expected(x, tiles)
    assert torch.equal(y.cpu(), expected_y)
    assert torch.equal(sums.cpu(), expected_sums)
