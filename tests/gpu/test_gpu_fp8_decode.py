"""Decoding from an 8-bit KV cache on a GPU (issue 45, part 2's rows): the accuracy rule of
tests/support/fp8_cache_cases.py on the GPU (the append bit for bit, O and L against the float64
oracle on the dequantised keys), contiguous and paged, split or not. Its speed is the GPU check's
decode section's `fagen_fp8` rows (fagen/bench/decode: the same step as `fagen`'s over the cache
quantised to e4m3, half the bytes read, as TB/s and a share of the copy bandwidth).

Marked `gpu`: the GPU check's correctness section runs it. `FAGEN_GPU_TESTS_DEVICE=cpu` runs the
same logic through the emulator.
"""

from __future__ import annotations

import os

import pytest
import torch

from fagen.bench.gpu_cases import FP8_DECODE_CASES
from fp8_cache_cases import Fp8Case, check_fp8_call

DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", list(FP8_DECODE_CASES))
def test_an_fp8_cache_step_meets_the_accuracy_rule(name):
    case_args, call_args = FP8_DECODE_CASES[name]
    check_fp8_call(Fp8Case(**case_args), device=DEVICE, **call_args)
