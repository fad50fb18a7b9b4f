"""The sm90 family's forward (templates/hopper_fwd.cu.j2, Spec.arch_family='sm90') on a compute
capability 9.0 GPU, with the sm80 backward after it: the emulator's cases
(tests/kernels/test_sm90_forward.py) and larger ones, against the same float64 oracle by the same
rule (kernel_cases.run_and_check), the launch path's tensor maps encoded by the driver. Marked `gpu`
and `twins`: the GPU check runs it among the first, before anything is built on it."""

from __future__ import annotations

import pytest
import torch

from gpu_twin_launch import require_capability
from kernel_cases import Shape, run_and_check
from fagen.spec import Spec

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPECS = [Spec(64, dtype="bf16", mask="causal", arch_family="sm90"), Spec(128, dtype="fp16", arch_family="sm90"),
         Spec(64, dtype="fp16", key_padding=True, arch_family="sm90"),
         Spec(128, dtype="bf16", mask="causal", key_padding=True, arch_family="sm90"),
         Spec(256, dtype="bf16", mask="causal", arch_family="sm90"), Spec(256, dtype="fp16", arch_family="sm90"),
         Spec(192, head_dim_v=128, dtype="bf16", mask="causal", arch_family="sm90")]
SHAPES = [Shape(2, 150, 200, heads=4, kv_heads=2), Shape(1, 200, 130, 2, 1), Shape(1, 1000, 2049, heads=3, kv_heads=1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_sm90_forward_on_the_gpu(spec, shape):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("the sm90 family's cubins are sm_90a: compute capability 9.0 only")
    run_and_check(spec, shape, device="cuda")
