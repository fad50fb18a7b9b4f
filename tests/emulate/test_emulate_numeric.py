"""fagen/numeric.cuh's special-function wrappers: the GPU side is the PTX instruction, and the
emulated twin errs as much as the PTX ISA allows that instruction to, and no more.

The bound is the PTX ISA's (tanh: "maximum relative error 2^-10.987" for tanh.approx.f32),
written in the tests independently of the header's constant (kernel_cases.TANH_APPROX_BOUND):
a twin and a test that shared a misread bound would agree with each other and not with the
hardware. (This file's first run caught the header's constant computed wrong: 4.96e-4 for
4.93e-4.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fagen.emulate import load_module
from kernel_cases import TANH_APPROX_BOUND
from nvrtc_ptx import nvrtc_ptx
from tanh_case import SOURCE as TANH   # the kernel tests/gpu/test_gpu_tanh.py runs on the hardware

TWIN_ARITHMETIC = 4 * 2.0 ** -24      # the twin's own work: the host's tanhf (within 2 ulp), one fp32 product


def _tanh_twin(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    load_module(TANH).get_function("tanh_approx_of")(((x.numel() + 127) // 128,), (128,),
                                                      (x, y, np.int32(x.numel())))
    return y


def test_the_tanh_twin_errs_up_to_the_isa_bound_and_no_further():
    x = torch.cat([torch.linspace(-12.0, 12.0, 24001), torch.tensor([1e-30, -1e-30, 3e-8, 88.0, -88.0])])
    got, exact = _tanh_twin(x).double(), torch.tanh(x.double())
    relative = (got - exact).abs() / exact.abs()
    assert bool((relative <= TANH_APPROX_BOUND + TWIN_ARITHMETIC).all()), float(relative.max())
    # Positive control: the twin is not the exact tanh; it reaches the bound, both ways.
    assert float(relative.max()) >= 0.9 * TANH_APPROX_BOUND
    signed = (got - exact) / exact.abs()
    assert float(signed.max()) > 0.5 * TANH_APPROX_BOUND and float(signed.min()) < -0.5 * TANH_APPROX_BOUND
    assert bool((got.abs() <= 1).all())


def test_the_tanh_twin_keeps_signs_and_zeros_and_its_limits_within_the_bound():
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e4, -1e4])
    got = _tanh_twin(x)
    assert got[0].item() == 0.0 and got[1].item() == 0.0
    limits = got[2:].double()
    assert limits.sign().tolist() == [1.0, -1.0, 1.0, -1.0]
    assert bool(((limits.abs() - 1).abs() <= TANH_APPROX_BOUND + TWIN_ARITHMETIC).all())
    assert math.isnan(_tanh_twin(torch.tensor([math.nan]))[0].item())


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_the_tanh_wrapper_is_the_ptx_instruction_under_nvrtc(arch):
    assert "tanh.approx.f32" in nvrtc_ptx(TANH, arch)
