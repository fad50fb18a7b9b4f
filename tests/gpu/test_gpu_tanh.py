"""tanh.approx.f32 (fagen/numeric.cuh tanh_approx: the softcap's tanh) on the hardware: its error
over a dense sweep of inputs (tests/support/tanh_case.py) against float64 tanh, measured and held
to the PTX ISA's bound, which the emulator's twin errs by in full: so the twin is conservative
where the hardware keeps the ISA's word.

Marked `gpu` and `twins`: the GPU check runs it first, and its report prints what it measured
(record_property: max relative and absolute error, and where) in the short table, for a later
session to copy (docs/gpu-check.md says what to do with it). FAGEN_GPU_TESTS_DEVICE=cpu runs the
same sweep through the emulator's twin, which must reach the bound (a measurement that found
less there would not be measuring).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kernel_cases import TANH_APPROX_BOUND
from tanh_case import KERNEL, SATURATING, SIGNED_ZEROS, SOURCE, errors, launch, normal_sweep, subnormal_sweep

DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
# A record run (fagen.bench.record_plugin) lists the kernels the gpu tests load through fagen's ops:
# this one loads its own, and would only spend the emulator's seconds there.
RECORDING = bool(os.environ.get("FAGEN_RECORD_KERNELS"))
pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(RECORDING, reason="loads no kernel of fagen's ops: nothing to record")]
# The twin's own arithmetic past its modelled error (the host's tanhf within 2 ulp, one fp32
# product; tests/emulate/test_emulate_numeric.py); the hardware has none of it to excuse.
TWIN_ARITHMETIC = 4 * 2.0 ** -24


@pytest.fixture(scope="module")
def tanh_approx():
    """The wrapper's kernel on DEVICE: NVRTC for this GPU (tanh.approx needs compute capability
    7.5), or the emulator's twin."""
    if DEVICE == "cpu":
        from fagen.emulate import load_module

        return load_module(SOURCE).get_function(KERNEL)
    from gpu_twin_launch import gpu_function, require_capability

    return gpu_function(SOURCE, KERNEL, require_capability(7, 5))


def _on_device(kernel, x: torch.Tensor) -> torch.Tensor:
    return launch(kernel, x.to(DEVICE)).cpu()


def test_tanh_approx_errs_within_the_isa_bound(tanh_approx, record_property):
    x = normal_sweep()
    measured = errors(x, _on_device(tanh_approx, x))
    tiny = subnormal_sweep()
    subnormal = errors(tiny, _on_device(tanh_approx, tiny))   # measured, not held (tanh_case's doc)
    # On the GPU check's GPU (its report names it); the emulator's run is its twin's error.
    for name, value in (("inputs", measured["inputs"]), ("max_rel", f"{measured['max_rel']:.4g}"),
                        ("at_x", f"{measured['max_rel_at']:.6g}"), ("max_abs", f"{measured['max_abs']:.4g}"),
                        ("abs_at_x", f"{measured['max_abs_at']:.6g}"), ("subnormal_max_rel", f"{subnormal['max_rel']:.4g}"),
                        ("isa_bound", f"{TANH_APPROX_BOUND:.4g}")):
        record_property(name, value)
    slack = TWIN_ARITHMETIC if DEVICE == "cpu" else 0.0
    assert measured["max_rel"] <= TANH_APPROX_BOUND + slack, measured
    if DEVICE == "cpu":   # positive control: the twin errs by the whole bound, and the sweep finds it
        assert measured["max_rel"] >= 0.99 * TANH_APPROX_BOUND, measured


def test_tanh_approx_keeps_zeros_and_signs_and_saturates_within_the_bound(tanh_approx):
    """The ISA's corner cases: +-0 give +-0, NaN gives NaN; far inputs, infinities included,
    come out at +-1 within the bound (the ISA names exactly +-1 for the infinities; the twin errs
    by its bound there too)."""
    zeros = _on_device(tanh_approx, torch.tensor(SIGNED_ZEROS))
    assert zeros.tolist() == [0.0, 0.0] and [math.copysign(1, z) for z in zeros.tolist()] == [1.0, -1.0]
    assert math.isnan(_on_device(tanh_approx, torch.tensor([math.nan])).item())
    far = torch.tensor(SATURATING)
    got = _on_device(tanh_approx, far).double()
    assert got.sign().tolist() == far.sign().tolist(), got
    slack = TWIN_ARITHMETIC if DEVICE == "cpu" else 0.0
    assert bool(((got.abs() - 1).abs() <= TANH_APPROX_BOUND + slack).all()), got
