"""What the GPU row modules share (tests/gpu/test_gpu_sm90_backward_rows.py, test_gpu_fp8_forward.py,
test_gpu_fp8_backward.py): where they run (FAGEN_GPU_TESTS_DEVICE: cuda, or cpu for the emulator),
the sm90 family's GPU, and one timing."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"


def require_sm90() -> None:
    if ON_GPU and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family's kernels are sm_90a: compute capability 9.0 only")


def timed_ms(fn) -> float:
    """fn's median time in milliseconds (CUDA events, two warm-up calls, at least five timed)."""
    from fagen.bench.timing import time_cuda

    return time_cuda(fn, warmup=2, min_repeats=5).median_ms
