"""stmatrix (fagen/stmatrix.cuh) in the emulator against the PTX ISA's fragment figures
(tests/support/isa_fragments.py: STMATRIX), and back through ldmatrix; the same source through
NVRTC for sm_90, and (tests/gpu/test_gpu_stmatrix.py) on the hardware."""

from __future__ import annotations

import numpy as np
import pytest

from fagen.emulate import EmulationError, load_module
from stmatrix_case import CASES, SOURCE, expected_tile, run

@pytest.fixture(scope="module")
def kernel():
    return load_module(SOURCE).get_function("stmatrix_layout")


@pytest.mark.parametrize("count, transpose", CASES, ids=[f"x{c}{'.trans' if t else ''}" for c, t in CASES])
def test_stmatrix_follows_the_isa_figure(kernel, count, transpose):
    regs, perm, tile, back = run(kernel, "cpu", count, transpose)
    np.testing.assert_array_equal(tile, expected_tile(regs, perm, count, transpose))
    if count == 4:   # ldmatrix reads back what stmatrix stored, register for register
        np.testing.assert_array_equal(back.reshape(32, 4), regs)


def test_a_misaligned_row_is_reported():
    source = SOURCE.replace("unsigned short* row = tile + perm[lane] * 8;",
                            "unsigned short* row = tile + perm[lane] * 8 + 1;")
    bad = load_module(source).get_function("stmatrix_layout")
    with pytest.raises(EmulationError, match="stmatrix.x1: lane 0's row address .* is not 16-byte aligned"):
        run(bad, "cpu", 1, False)


def test_nvrtc_compiles_it_for_sm_90():
    pytest.importorskip("cuda.bindings")
    from fagen.kernels.compile import nvrtc_compile

    cubin, log = nvrtc_compile(SOURCE, "sm_90")
    assert cubin, log
